"""The placement diagnostics: each measurement against a hand computation, the synthetic task, divergence detection,
and the `diagnose` command's report folder."""

import argparse
import json
import math
import re
import sys

import pytest
import torch
from conftest import PLACEMENTS, build, real
from transformers import BertConfig, BertForMaskedLM

import encoderstack
from encoderstack.commands.diagnose import add_diagnose_command
from encoderstack.diagnostics import (
    ReportSettings,
    SyntheticMLMTask,
    activation_rms_per_layer,
    consecutive_layer_similarity,
    diagnostic_config,
    divergence,
    gradient_norms_per_layer,
    residual_streams,
    run_report,
    train_synthetic_mlm,
)
from encoderstack.diagnostics.plots import FIGURES
from encoderstack.diagnostics.report import single_threaded
from encoderstack.diagnostics.synthetic import HALF_LENGTH, MASK, NUM_SPECIAL, build_masked_lm


@pytest.fixture(autouse=True)
def one_thread():
    """As in the report: models this small train many times faster on one thread than on two shared ones."""
    with single_threaded():
        yield


def labelled(inputs, seed=2):
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 99, inputs["input_ids"].shape, generator=generator)
    return {**inputs, "labels": labels.masked_fill(inputs["attention_mask"] == 0, -100)}


def hand_rms(hidden, attention_mask):
    weights = attention_mask.unsqueeze(-1).float()
    return math.sqrt((hidden.pow(2) * weights).sum().item() / (attention_mask.sum().item() * hidden.shape[-1]))


def hand_mean_cosine(first, second, attention_mask):
    cosines = (first * second).sum(-1) / (first.norm(dim=-1) * second.norm(dim=-1))
    return ((cosines * attention_mask).sum() / attention_mask.sum()).item()


def diagnose(*argv) -> int:
    parser = argparse.ArgumentParser(prog="encoderstack")
    add_diagnose_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["diagnose", *argv])
    return args.run(args)


TINY_REPORT = ("--layers", "1,2", "--steps", "3", "--hidden-size", "16")


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_gradient_norms_are_the_norm_of_each_layers_parameter_gradients_after_one_mlm_backward(placement, inputs):
    model = build(encoderstack.EncoderStackForMaskedLM, norm_placement=placement)
    inputs = labelled(inputs)
    model(**inputs).loss.backward()
    by_hand = [math.sqrt(sum(p.grad.pow(2).sum().item() for p in layer.parameters())) for layer in model.model.layers]

    measured = gradient_norms_per_layer(model, inputs)

    assert measured == pytest.approx(by_hand, rel=1e-5)
    assert all(param.grad is None for param in model.parameters())


def test_a_bare_encoder_takes_its_gradient_norms_from_a_fixed_random_readout_of_its_output(inputs):
    model = build(encoderstack.EncoderStackModel, norm_placement="pre")
    output = model(**inputs).last_hidden_state
    readout = torch.randn(output.shape, generator=torch.Generator().manual_seed(0))
    loss = (output * readout * inputs["attention_mask"].unsqueeze(-1)).sum() / inputs["attention_mask"].sum()
    loss.backward()
    by_hand = [math.sqrt(sum(p.grad.pow(2).sum().item() for p in layer.parameters())) for layer in model.layers]

    assert gradient_norms_per_layer(model, inputs) == pytest.approx(by_hand, rel=1e-5)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_activation_rms_and_similarity_match_a_hand_computation_from_output_hidden_states(placement, inputs):
    model = build(encoderstack.EncoderStackModel, norm_placement=placement, num_hidden_layers=4)
    # the last entry of output_hidden_states is the model output after the final step; the others are the streams
    hidden_states = model(**inputs, output_hidden_states=True).hidden_states[:-1]
    mask = inputs["attention_mask"]

    rms = activation_rms_per_layer(model, inputs)["hidden"]
    similarity = consecutive_layer_similarity(model, inputs)["hidden"]

    assert len(rms) == 5 and len(similarity) == 4
    assert rms[:-1] == pytest.approx([hand_rms(h, mask) for h in hidden_states], rel=1e-5)
    expected = [hand_mean_cosine(a, b, mask) for a, b in zip(hidden_states, hidden_states[1:])]
    assert similarity[:-1] == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_the_last_streams_are_what_the_final_step_turns_into_the_model_output(placement, inputs):
    model = build(encoderstack.EncoderStackModel, norm_placement=placement, resi_dual_scale=0.5)
    output = model(**inputs).last_hidden_state
    streams = residual_streams(model, inputs)

    if placement == "resi_dual":
        final = streams.hidden[-1] + model.final.norm(streams.dual[-1] * 0.5)
        assert torch.equal(streams.dual[0], streams.hidden[0])  # d starts from the embeddings, in their units
    else:
        final = model.final.norm(streams.hidden[-1])
        assert streams.dual is None
    mask = inputs["attention_mask"]
    torch.testing.assert_close(real(final, mask), real(output, mask), rtol=1e-5, atol=1e-5)
    assert set(activation_rms_per_layer(model, inputs)) == ({"hidden", "dual"} if placement == "resi_dual"
                                                            else {"hidden"})


def test_the_measurements_give_identical_numbers_for_the_same_seed():
    config = diagnostic_config("post", 2, hidden_size=16)
    sample = SyntheticMLMTask().sample(4, torch.Generator().manual_seed(0))

    def measure():
        model = build_masked_lm(config, seed=3)
        return (gradient_norms_per_layer(model, sample), activation_rms_per_layer(model, sample),
                consecutive_layer_similarity(model, sample), train_synthetic_mlm(config, 5, 1e-3, 2, seed=3).losses)

    assert measure() == measure()


def test_training_on_the_synthetic_task_lowers_the_loss():
    run = train_synthetic_mlm(diagnostic_config("pre", 1, hidden_size=16), steps=40, lr=3e-3, seed=0)

    assert len(run.losses) == 40
    assert run.divergence is None
    assert sum(run.losses[-5:]) / 5 < run.losses[0] - 0.05


def test_the_synthetic_task_masks_tokens_that_its_grammar_and_permutation_make_predictable():
    task = SyntheticMLMTask()
    sample = task.sample(8, torch.Generator().manual_seed(0))
    labels, input_ids = sample["labels"], sample["input_ids"]
    tokens = torch.where(labels == -100, input_ids, labels) - NUM_SPECIAL
    first, second = tokens[:, 1 : HALF_LENGTH + 1], tokens[:, HALF_LENGTH + 2 : -1]

    assert torch.equal(second, task.permutation[first])
    for previous, following in zip(first[:, :-1].flatten(), first[:, 1:].flatten()):
        assert following in task.successors[previous]
    assert torch.equal(labels != -100, input_ids == MASK)
    assert ((labels != -100).sum(dim=1) == round(0.15 * 2 * HALF_LENGTH)).all()


def test_divergence_detection_flags_non_finite_and_rising_losses():
    assert divergence([3.5, 3.1, float("nan")]) == "loss nan at step 3"
    assert divergence([3.5, float("inf")]) == "loss inf at step 2"
    assert "above the first" in divergence([3.5] + [3.6] * 9)
    assert divergence([3.5, 3.0, 2.0]) is None


def test_a_training_run_that_produces_nan_stops_there_and_counts_as_diverged():
    model = build_masked_lm(diagnostic_config("post", 1, hidden_size=16), seed=0)
    with torch.no_grad():
        model.model.layers[0].mlp.up.weight[0, 0] = float("nan")

    run = train_synthetic_mlm(model, steps=10, lr=1e-3)

    assert len(run.losses) == 1 and math.isnan(run.losses[0])
    assert run.divergence == "loss nan at step 1"


def test_the_measurements_work_on_a_converted_bert_checkpoint(tmp_path):
    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=37, max_position_embeddings=64))
    bert.save_pretrained(tmp_path / "bert")
    model = encoderstack.EncoderStackForMaskedLM.from_pretrained(tmp_path / "bert")
    sample = SyntheticMLMTask().sample(4, torch.Generator().manual_seed(0))

    norms = gradient_norms_per_layer(model, sample)

    assert len(norms) == 2 and all(math.isfinite(norm) and norm > 0 for norm in norms)
    assert len(activation_rms_per_layer(model, sample)["hidden"]) == 3
    assert len(consecutive_layer_similarity(model, sample)["hidden"]) == 2


def test_the_quick_command_writes_every_file_it_promises(tmp_path):
    out = tmp_path / "report"

    assert diagnose("--quick", *TINY_REPORT, "--out", str(out)) == 0

    index = (out / "index.md").read_text()
    linked = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", index)
    assert sorted(linked) == sorted(FIGURES)
    assert all((out / name).stat().st_size > 0 for name in linked)
    results = json.loads((out / "results.json").read_text())["results"]
    assert {(r["placement"], r["num_layers"]) for r in results} == {(p, n) for p in PLACEMENTS for n in (1, 2)}
    assert "encoderstack diagnose --layers 1,2" in index and "| resi_dual (d stream) | 2 |" in index
    assert [path.name for path in tmp_path.iterdir()] == ["report"]  # no partial folder left behind


def test_an_existing_report_folder_is_refused_without_force_before_any_work(tmp_path, capsys):
    out = tmp_path / "report"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    assert diagnose(*TINY_REPORT, "--out", str(out)) == 2

    assert "already exists" in capsys.readouterr().err
    assert [path.name for path in out.iterdir()] == ["notes.txt"]


def test_force_replaces_an_earlier_report_folder(tmp_path):
    out = tmp_path / "report"
    settings = ("--layers", "1", "--placements", "post", "--steps", "2", "--hidden-size", "16", "--out", str(out))
    assert diagnose(*settings) == 0
    (out / "notes.txt").write_text("old")

    assert diagnose(*settings, "--force") == 0

    assert not (out / "notes.txt").exists() and (out / "index.md").exists()


def test_force_refuses_a_folder_that_is_not_a_report(tmp_path, capsys):
    out = tmp_path / "report"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    assert diagnose(*TINY_REPORT, "--out", str(out), "--force") == 2

    assert "not replaced: encoderstack did not write it" in capsys.readouterr().err
    assert [path.name for path in out.iterdir()] == ["notes.txt"]


def test_without_matplotlib_the_report_fails_with_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)

    with pytest.raises(ImportError, match=r"pip install 'encoderstack\[diagnostics\]'"):
        run_report(tmp_path / "report")
    assert not (tmp_path / "report").exists()


@pytest.mark.parametrize("argv", [("--placements", "post,middle"), ("--layers", "6,0"), ("--steps", "-1"),
                                  ("--hidden-size", "20")])
def test_the_command_refuses_bad_options(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        diagnose(*argv)

    assert exit_info.value.code == 2
    assert "diagnose: error:" in capsys.readouterr().err


@pytest.mark.parametrize("lr", ["nan", "inf", "-1", "0", "fast"])
def test_the_command_refuses_a_learning_rate_that_is_not_a_positive_number_before_any_work(lr, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        diagnose(*TINY_REPORT, "--lr", lr, "--out", str(tmp_path / "report"))

    assert exit_info.value.code == 2
    assert f"argument --lr: expected a positive finite number, got {lr!r}" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("lr", [float("nan"), float("-inf"), -1e-3, 0.0])
def test_report_settings_refuse_a_learning_rate_that_is_not_a_positive_number(lr):
    with pytest.raises(ValueError, match=f"lr must be a positive finite number, got {lr}"):
        ReportSettings(lr=lr)

"""The placement diagnostics: each measurement against a hand computation, the synthetic task, divergence detection,
the `diagnose` command's report folder, and its real-text route (`--corpus`) through the pre-training data path."""

import argparse
import hashlib
import json
import math
import re
import signal
import sys

import pytest
import torch
import transformers
from conftest import PLACEMENTS, build, real, record_admin_profiling
from test_pretrain_output import sigterm_after
from transformers import BertConfig, BertForMaskedLM

import encoderstack
from encoderstack import pretrain as pretrain_module
from encoderstack.commands.diagnose import add_diagnose_command
from encoderstack.configuration_encoderstack import NORM_PLACEMENTS
from encoderstack.diagnostics import (
    ReportSettings,
    SyntheticMLMTask,
    activation_rms_per_layer,
    angular_distance_per_layer,
    consecutive_layer_similarity,
    diagnostic_config,
    divergence,
    gradient_norms_per_layer,
    residual_streams,
    run_report,
    train_synthetic_mlm,
)
from encoderstack.diagnostics import corpus as corpus_route
from encoderstack.diagnostics.corpus import stdlib_corpus
from encoderstack.diagnostics.plots import FIGURES
from encoderstack.diagnostics.report import single_threaded
from encoderstack.diagnostics.sweep import SweepSettings, run_sweep
from encoderstack.diagnostics.synthetic import (
    HALF_LENGTH,
    MASK,
    NUM_SPECIAL,
    PROFILING_BATCH_SIZE,
    build_masked_lm,
    diagnostic_fields,
)
from encoderstack.pretrain import pretrain


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
TINY_CORPUS_REPORT = (
    "--layers",
    "1,2",
    "--placements",
    "post,deepnorm",
    "--steps",
    "3",
    "--hidden-size",
    "16",
    "--seed",
    "5",
)


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    """Real text: the start of the stdlib corpus that `pretrain` ships (about 60 training sequences)."""
    return stdlib_corpus(tmp_path_factory.mktemp("text") / "stdlib.txt", max_bytes=12_000)


@pytest.fixture(scope="module")
def corpus_report(text, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "report"
    assert diagnose(*TINY_CORPUS_REPORT, "--warmup-steps", "2", "--corpus", str(text), "--out", str(out)) == 0
    return out


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
    assert set(activation_rms_per_layer(model, inputs)) == (
        {"hidden", "dual"} if placement == "resi_dual" else {"hidden"}
    )


def test_the_measurements_give_identical_numbers_for_the_same_seed():
    config = diagnostic_config("post", 2, hidden_size=16)
    sample = SyntheticMLMTask().sample(4, torch.Generator().manual_seed(0))

    def measure():
        model = build_masked_lm(config, seed=3)
        return (
            gradient_norms_per_layer(model, sample),
            activation_rms_per_layer(model, sample),
            consecutive_layer_similarity(model, sample),
            train_synthetic_mlm(config, 5, 1e-3, 2, seed=3).losses,
        )

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
    bert = BertForMaskedLM(
        BertConfig(
            vocab_size=99,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=37,
            max_position_embeddings=64,
        )
    )
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
    every_row = set(PLACEMENTS) - {"peri"}  # peri is sandwich's row
    assert {(r["placement"], r["num_layers"]) for r in results} == {(p, n) for p in every_row for n in (1, 2)}
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


@pytest.mark.parametrize(
    "argv",
    [
        ("--placements", "post,middle"),
        ("--layers", "6,0"),
        ("--steps", "-1"),
        ("--hidden-size", "20"),
        ("--warmup-steps", "-1"),
    ],
)
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


def test_the_corpus_route_writes_the_report_with_its_corpus_token_counts_steps_sizes_warmup_and_seed(
    corpus_report, text
):
    record = json.loads((corpus_report / "results.json").read_text())
    index = (corpus_report / "index.md").read_text()

    data = record["data"]
    assert data["corpus"] == data["train"][0]["file"] == str(text) and len(data["train"][0]["sha256"]) == 64
    assert data["train_tokens"] > data["train_sequences"] > 0 and data["eval_masked_tokens"] > 0
    assert (
        record["settings"] | {"layers": [1, 2], "steps": 3, "hidden_size": 16, "warmup": 2, "seed": 5}
        == record["settings"]
    )
    assert record["wall_seconds"] > 0 and record["threads"] == 1
    results = record["results"]
    assert {(r["placement"], r["num_layers"]) for r in results} == {
        (p, n) for p in ("post", "deepnorm") for n in (1, 2)
    }
    for result in results:
        assert [len(result["losses"][key]) for key in ("warmup", "no_warmup")] == [3, 3]
        assert set(result["eval_loss"]) == {"init", "warmup", "no_warmup"}
        assert all(math.isfinite(loss) for loss in result["eval_loss"].values())
    assert (
        f"encoderstack diagnose --layers 1,2 --placements post,deepnorm --steps 3 --hidden-size 16 --lr 0.001 "
        f"--seed 5 --warmup-steps 2 --corpus {text}"
    ) in index
    for fact in (
        f"{data['train_sequences']} sequences, {data['train_tokens']} tokens",
        "hidden size 16",
        "over the first 2 steps",
        "minutes of wall clock on one thread",
        "| eval loss at init |",
    ):
        assert fact in index
    assert sorted(re.findall(r"!\[[^\]]*\]\(([^)]+)\)", index)) == sorted(FIGURES)
    assert all((corpus_report / name).stat().st_size > 0 for name in FIGURES)
    assert [path.name for path in corpus_report.parent.iterdir()] == ["report"]  # no data cache or partial folder


def test_the_warmup_steps_reach_the_trainer_and_the_runs_without_warmup_start_at_the_full_rate(corpus_report):
    results = json.loads((corpus_report / "results.json").read_text())["results"]

    for result in results:  # both start from the same weights and batches: only the learning rate tells them apart
        warmup, no_warmup = result["losses"]["warmup"], result["losses"]["no_warmup"]
        assert warmup[0] == no_warmup[0]
        assert warmup[1] == pytest.approx(warmup[0], abs=0.05)  # the first update's rate is 0 under warm-up
        assert warmup[1:] != no_warmup[1:]


def test_the_corpus_route_trains_on_the_very_sequences_pretrain_trains_on(text, tmp_path, monkeypatch):
    seen = []
    train = transformers.Trainer.train

    def recording(trainer, *args, **kwargs):
        seen.append(
            (
                trainer.train_dataset.to_dict()["input_ids"],
                trainer.eval_dataset.to_dict()["input_ids"],
                trainer.eval_dataset.to_dict()["labels"],
            )
        )
        return train(trainer, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "train", recording)
    # `tokenizers` breaks ties between equally frequent merges in hash order: one tokenizer per training text
    tokenizers, train_wordpiece = {}, pretrain_module.train_wordpiece

    def one_tokenizer_per_text(texts, vocab_size):
        key = (tuple(texts), vocab_size)
        if key not in tokenizers:
            tokenizers[key] = train_wordpiece(key[0], vocab_size)
        return tokenizers[key]

    monkeypatch.setattr(pretrain_module, "train_wordpiece", one_tokenizer_per_text)
    record = pretrain(
        config=diagnostic_fields("post", 1, 16),
        train_tokenizer=corpus_route.VOCAB_SIZE,
        train=text,
        output=tmp_path / "pretrained",
        max_length=corpus_route.MAX_LENGTH,
        max_steps=1,
        seed=3,
    )
    assert (
        diagnose(
            "--layers",
            "1",
            "--placements",
            "post",
            "--steps",
            "1",
            "--hidden-size",
            "16",
            "--seed",
            "3",
            "--corpus",
            str(text),
            "--out",
            str(tmp_path / "report"),
        )
        == 0
    )

    pretrained, *diagnosed = seen
    assert len(tokenizers) == 1 and len(diagnosed) == 2 and all(run == pretrained for run in diagnosed)
    data = json.loads((tmp_path / "report" / "results.json").read_text())["data"]
    assert data == {**record["data"], "corpus": str(text)}


def test_a_sigterm_during_the_corpus_route_leaves_no_data_cache_beside_the_report(text, tmp_path, monkeypatch):
    sigterm_after(corpus_route, "prepare_text", monkeypatch)
    with pytest.raises(SystemExit) as exit:
        diagnose(
            "--layers", "1", "--steps", "1", "--hidden-size", "16", "--corpus", str(text), "--out", str(tmp_path / "r")
        )
    assert exit.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_corpus_stdlib_is_pretrains_stdlib_corpus_built_at_run_time(tmp_path, monkeypatch):
    built = []

    def small_stdlib_corpus(path):
        built.append(path)
        return stdlib_corpus(path, max_bytes=12_000)

    monkeypatch.setattr(corpus_route, "stdlib_corpus", small_stdlib_corpus)
    assert (
        diagnose(
            "--layers",
            "1",
            "--placements",
            "pre",
            "--steps",
            "1",
            "--hidden-size",
            "16",
            "--corpus",
            "stdlib",
            "--out",
            str(tmp_path / "report"),
        )
        == 0
    )

    data = json.loads((tmp_path / "report" / "results.json").read_text())["data"]
    assert len(built) == 1 and data["corpus"] == "stdlib"
    same_text = stdlib_corpus(tmp_path / "again.txt", max_bytes=12_000).read_bytes()
    assert data["train"][0]["sha256"] == hashlib.sha256(same_text).hexdigest()
    assert "Python's standard-library docstrings" in (tmp_path / "report" / "index.md").read_text()


@pytest.mark.parametrize(
    "name, data, message",
    [
        ("missing.txt", None, "missing.txt: no such file or folder"),
        ("empty.txt", b"\n\n", "empty.txt: no text (the file is empty or blank)"),
        ("notes.csv", b"a,b\n", "notes.csv: not a .txt or .jsonl file"),
        ("bad.jsonl", b'{"text": "fine"}\n{"words": "no"}\n', "bad.jsonl: line 2: missing field 'text'"),
    ],
)
def test_a_bad_corpus_is_refused_with_one_line_and_exit_2_leaving_nothing(name, data, message, tmp_path, capsys):
    corpus = tmp_path / "data" / name
    corpus.parent.mkdir()
    if data is not None:
        corpus.write_bytes(data)

    assert diagnose(*TINY_CORPUS_REPORT, "--corpus", str(corpus), "--out", str(tmp_path / "report")) == 2

    lines = capsys.readouterr().err.splitlines()  # datasets' progress bars come first
    assert lines[-1].startswith("encoderstack: error: ") and message in lines[-1]
    assert sum("error" in line for line in lines) == 1
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data"]


def test_a_diagnosed_admin_model_starts_from_the_omegas_profiling_gives_on_a_task_batch():
    model = build_masked_lm(diagnostic_config("admin", 2, hidden_size=32), seed=3)
    residuals = [r for layer in model.model.layers for r in (layer.attention_residual, layer.mlp_residual)]
    stored = [residual.omega[0].item() for residual in residuals]
    batch = SyntheticMLMTask().sample(PROFILING_BATCH_SIZE, torch.Generator().manual_seed(3))
    assert stored[1] != 1.0
    assert stored == pytest.approx(model.profile_admin(batch["input_ids"], batch["attention_mask"]), rel=1e-6)


@pytest.mark.parametrize("placement", ["post", "lns"])
def test_angular_distance_is_the_mean_over_real_tokens_of_the_angle_between_consecutive_streams_over_pi(
    placement, inputs
):
    model = build(encoderstack.EncoderStackModel, norm_placement=placement, num_hidden_layers=3)
    hidden_states = model(**inputs, output_hidden_states=True).hidden_states[:-1]
    mask = inputs["attention_mask"].bool()

    def by_hand(first, second):
        first, second = first.double(), second.double()
        cosines = (first * second).sum(-1) / (first.norm(dim=-1) * second.norm(dim=-1))
        return (cosines[mask].clamp(-1, 1).arccos() / math.pi).mean().item()

    distances = angular_distance_per_layer(model, inputs)

    assert len(distances) == 3
    assert distances[:-1] == pytest.approx([by_hand(a, b) for a, b in zip(hidden_states, hidden_states[1:])], rel=1e-5)


def test_the_default_grid_trains_each_placement_row_once_so_not_peri_beside_sandwich():
    placements = ReportSettings().placements

    assert "sandwich" in placements and "peri" not in placements
    assert sorted(placements) == sorted(set(NORM_PLACEMENTS) - {"peri"})


TINY_SWEEP = (
    "--sweep",
    "--layers",
    "2",
    "--placements",
    "post,lns",
    "--lrs",
    "1e-3,3e-2",
    "--seeds",
    "2",
    "--seed",
    "4",
    "--steps",
    "2",
    "--hidden-size",
    "16",
)


@pytest.fixture(scope="module")
def sweep_report(text, tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "report"
    lines = []
    settings = SweepSettings(
        corpus=str(text),
        layers=(2,),
        placements=("post", "lns"),
        lrs=(1e-3, 3e-2),
        seeds=2,
        seed=4,
        steps=2,
        hidden_size=16,
    )
    run_sweep(out, settings, progress=lines.append)
    return out, lines


def test_the_sweep_records_each_seeds_initialization_and_its_runs_at_every_rate_with_and_without_warmup(sweep_report):
    out, lines = sweep_report
    record = json.loads((out / "results.json").read_text())
    records = record["records"]

    inits = [(r["seed"], r["placement"]) for r in records if r["run"] == "init"]
    runs = [(r["seed"], r["placement"], r["lr"], r["warmup"]) for r in records if r["run"] == "trained"]
    assert inits == [(seed, placement) for seed in (4, 5) for placement in ("post", "lns")]
    assert sorted(runs) == sorted(
        (seed, placement, lr, warm) for seed, placement in inits for lr in (1e-3, 3e-2) for warm in (True, False)
    )
    for r in records:
        assert len(r["gradient_norms"]) == len(r["angular_distance"]) == 2
    for r in (r for r in records if r["run"] == "trained"):
        assert len(r["losses"]) == 2 and math.isfinite(r["eval_loss"])
    assert [json.loads(line.removeprefix("run ")) for line in lines] == records  # each as soon as it was made
    assert record["data"]["corpus"] == record["settings"]["corpus"]


def test_the_sweeps_runs_of_one_seed_start_from_one_initialization_and_other_seeds_from_others(sweep_report):
    records = json.loads((sweep_report[0] / "results.json").read_text())["records"]

    def first_losses(seed):
        return {
            r["losses"][0] for r in records if r["run"] == "trained" and r["seed"] == seed and r["placement"] == "post"
        }

    assert len(first_losses(4)) == len(first_losses(5)) == 1 and first_losses(4) != first_losses(5)


def test_the_sweep_report_has_a_row_per_cell_with_its_divergence_count_and_the_depth_profiles(sweep_report):
    index = (sweep_report[0] / "index.md").read_text()

    assert "every run of the grid" in index
    for placement in ("post", "lns"):
        for lr in ("0.001", "0.03"):
            for schedule in ("warm-up", "no warm-up"):
                assert re.search(
                    rf"\| {placement} \| 2 \| {lr} \| {schedule} \| \d/2 \|( [\d.]+ ± [\d.]+ \|){{3}}", index
                )
        assert len(re.findall(rf"\| {placement} \| 2 \| init \|  \| 2 \| [\d.]+ / [\d.]+ \|", index)) == 2
    assert "normal(0, 0.25)" in index  # hidden 16: the Xavier std 16 ** -0.5


def test_a_sweep_out_of_time_stops_between_runs_and_still_writes_its_report(text, tmp_path):
    assert diagnose(*TINY_SWEEP, "--budget-minutes", "1e-9", "--corpus", str(text), "--out", str(tmp_path / "r")) == 0

    assert json.loads((tmp_path / "r" / "results.json").read_text())["records"] == []
    assert "0 of the grid's 20 records" in (tmp_path / "r" / "index.md").read_text()


@pytest.mark.parametrize(
    "argv, message",
    [
        (("--lrs", "1e-3"), "--lrs needs --sweep"),
        (("--seeds", "3"), "--seeds needs --sweep"),
        (("--sweep",), "--sweep needs --corpus"),
        (("--sweep", "--corpus", "stdlib", "--lr", "1e-3"), "--lr does not apply to --sweep"),
        (("--sweep", "--corpus", "stdlib", "--quick"), "--quick does not apply to --sweep"),
        (("--sweep", "--corpus", "stdlib", "--hidden-size", "24", "--heads", "8"), "does not split into 8 heads"),
    ],
)
def test_sweep_options_out_of_place_are_refused_in_one_line_before_any_work(argv, message, tmp_path, capsys):
    assert diagnose(*argv, "--out", str(tmp_path / "report")) == 2

    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("encoderstack: error: ") and message in err[0]
    assert list(tmp_path.iterdir()) == []


def test_a_corpus_admin_model_trains_from_omegas_profiled_on_the_first_training_sequences(text, tmp_path, monkeypatch):
    profiled, at_start = record_admin_profiling(monkeypatch)

    assert (
        diagnose(
            "--layers",
            "2",
            "--placements",
            "admin",
            "--steps",
            "1",
            "--hidden-size",
            "16",
            "--corpus",
            str(text),
            "--out",
            str(tmp_path / "report"),
        )
        == 0
    )

    assert len(profiled) == 1 and len(at_start) == 2  # one initialization, trained with and without warm-up
    rows, omegas = profiled[0]
    assert omegas[1] != 1.0
    for first_rows, omegas_at_start in at_start:
        assert rows == first_rows
        assert omegas_at_start == pytest.approx(omegas, rel=1e-6)


def test_the_stdlib_corpus_lives_beside_the_diagnostics_and_pretrains_old_name_is_the_same_function():
    assert corpus_route.stdlib_corpus is pretrain_module.stdlib_corpus
    assert "stdlib_corpus" not in vars(pretrain_module)  # the old name only forwards

"""Checkpoints round-trip, resolve through the Auto classes, and load as remote code where the package is absent."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers
from conftest import HEADS, PLACEMENTS, batch, build, first_output, head_inputs, tiny_config
from safetensors.torch import load_file

import encoderstack
from encoderstack import AUTO_MAP

SAVED_BEFORE = Path(__file__).parent / "fixtures" / "saved" / "073c466"  # the release before the house round


def outputs_of(model, model_class):
    with torch.no_grad():
        return first_output(model(**head_inputs(model_class, batch())))


@pytest.mark.parametrize("model_class", HEADS, ids=lambda c: c.__name__)
def test_save_and_from_pretrained_round_trip_exactly(model_class, tmp_path):
    model = build(model_class, norm_placement="sandwich")
    model.save_pretrained(tmp_path)
    loaded = model_class.from_pretrained(tmp_path).eval()
    expected = model.state_dict()
    assert loaded.state_dict().keys() == expected.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    # Same weights, but memory-mapped tensors can sit at another alignment and take another BLAS path: the
    # outputs may differ in the last bit, hence a tolerance at float32 resolution.
    torch.testing.assert_close(outputs_of(loaded, model_class), outputs_of(model, model_class), atol=1e-6, rtol=0)


@pytest.mark.parametrize("folder", sorted(p.name for p in SAVED_BEFORE.iterdir() if p.is_dir()))
def test_a_folder_saved_by_the_previous_release_loads_and_gives_the_same_outputs(folder):
    """Written by tests/fixtures/saved/make_saved_fixtures.py with that release's package: its config fields, key
    names and conventions (the sliding window's radius, rotary parameters) must still mean what they meant."""
    expected = load_file(SAVED_BEFORE / folder / "expected.safetensors")
    inputs = {name: expected.pop(name) for name in ("input_ids", "attention_mask")}
    config = json.loads((SAVED_BEFORE / folder / "config.json").read_text())
    model = getattr(encoderstack, config["architectures"][0]).from_pretrained(SAVED_BEFORE / folder).eval()
    with torch.no_grad():
        outputs = model(**inputs)
    for name, tensor in expected.items():
        torch.testing.assert_close(outputs[name], tensor, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_every_placement_round_trips_through_auto_model(placement, tmp_path):
    model = build(encoderstack.EncoderStackModel, norm_placement=placement, position_embedding_type="rope")
    if placement == "admin":  # profiled omegas: weights that must round-trip
        model.profile_admin(**batch())
    model.save_pretrained(tmp_path)
    loaded = transformers.AutoModel.from_pretrained(tmp_path).eval()
    assert loaded.config.norm_placement == placement
    model_class = encoderstack.EncoderStackModel
    torch.testing.assert_close(outputs_of(loaded, model_class), outputs_of(model, model_class), atol=1e-6, rtol=0)


@pytest.mark.parametrize(
    "model_class", [encoderstack.EncoderStackModel, encoderstack.EncoderStackForMaskedLM], ids=lambda c: c.__name__
)
def test_from_pretrained_with_no_name_builds_the_model_from_a_config_and_a_state_dict(model_class):
    model = build(model_class, norm_placement="pre")
    loaded = model_class.from_pretrained(None, config=model.config, state_dict=model.state_dict()).eval()
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, model.state_dict()[name]), name
    assert torch.equal(outputs_of(loaded, model_class), outputs_of(model, model_class))


def test_every_auto_class_resolves_to_its_encoderstack_head():
    config = transformers.AutoConfig.for_model(
        "encoderstack", num_hidden_layers=1, hidden_size=32, num_attention_heads=4, intermediate_size=37, vocab_size=99
    )
    assert type(config) is encoderstack.EncoderStackConfig
    for auto_name, reference in AUTO_MAP.items():
        if auto_name != "AutoConfig":
            model = getattr(transformers, auto_name).from_config(config)
            assert type(model).__name__ == reference.split(".")[-1]


def test_importing_twice_is_harmless():
    import importlib

    importlib.reload(encoderstack)
    assert type(transformers.AutoModel.from_config(tiny_config())) is encoderstack.EncoderStackModel


def test_masked_lm_decoder_is_tied_to_the_word_embeddings(tmp_path):
    model = build(encoderstack.EncoderStackForMaskedLM)
    assert model.lm_head.decoder.weight is model.model.embeddings.word_embeddings.weight
    model.save_pretrained(tmp_path)
    loaded = encoderstack.EncoderStackForMaskedLM.from_pretrained(tmp_path)
    assert loaded.lm_head.decoder.weight is loaded.model.embeddings.word_embeddings.weight


def test_a_saved_checkpoint_carries_the_code_files_and_an_auto_map_for_every_auto_class(tmp_path):
    build(encoderstack.EncoderStackForTokenClassification).save_pretrained(tmp_path)
    assert {"configuration_encoderstack.py", "execution_encoderstack.py", "modeling_encoderstack.py"} <= set(
        os.listdir(tmp_path)
    )
    assert json.loads((tmp_path / "config.json").read_text())["auto_map"] == AUTO_MAP


REMOTE_LOAD = textwrap.dedent(
    """
    import sys
    sys.modules["encoderstack"] = None  # the package is not installed here
    import torch, transformers
    arguments = sys.argv[1:]  # folder, auto class name, expected outputs; as many triples as given
    for folder, auto_name, expected_path in zip(arguments[::3], arguments[1::3], arguments[2::3]):
        inputs = torch.load(expected_path)
        model = getattr(transformers, auto_name).from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        with torch.no_grad():
            out = model(**inputs["inputs"])
        out = next(getattr(out, k) for k in ("logits", "prediction_logits", "start_logits", "last_hidden_state")
                   if getattr(out, k, None) is not None)
        assert (out - inputs["expected"]).abs().max() <= 1e-6, (out - inputs["expected"]).abs().max()
        print("remote load ok", type(model).__name__, model.config.norm_placement, model.config.norm_type)
    """
)


def load_as_remote_code(tmp_path, arguments: list[str]) -> str:
    """Run REMOTE_LOAD on (folder, auto class, expected outputs) triples in a fresh interpreter; its stdout."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", REMOTE_LOAD, *arguments],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


@pytest.mark.parametrize("model_class", HEADS, ids=lambda c: c.__name__)
def test_a_saved_checkpoint_loads_with_trust_remote_code_where_the_package_cannot_be_imported(model_class, tmp_path):
    model = build(model_class, norm_placement="resi_dual")
    folder = tmp_path / "checkpoint"
    model.save_pretrained(folder)
    inputs = head_inputs(model_class, batch())
    torch.save({"inputs": inputs, "expected": outputs_of(model, model_class)}, tmp_path / "expected.pt")
    auto_name = next(name for name, ref in AUTO_MAP.items() if ref.endswith("." + model_class.__name__))
    stdout = load_as_remote_code(tmp_path, [str(folder), auto_name, str(tmp_path / "expected.pt")])
    assert f"remote load ok {model_class.__name__}" in stdout


def test_every_placement_and_norm_type_loads_as_remote_code_with_the_same_outputs(tmp_path):
    """One subprocess for all of them: each folder saved from a model with its own placement or norm type (Admin
    profiled, so that its omegas are weights worth carrying), loaded with `trust_remote_code` only."""
    cases = [{"norm_placement": placement} for placement in PLACEMENTS]
    cases += [{"norm_placement": "hybrid", "norm_type": "dyt"}, {"norm_placement": "mix", "norm_type": "derf"}]
    arguments = []
    for index, fields in enumerate(cases):
        model = build(encoderstack.EncoderStackModel, mix_ln_ratio=0.5, **fields)
        if fields["norm_placement"] == "admin":
            model.profile_admin(**batch())
        model.save_pretrained(tmp_path / f"checkpoint{index}")
        expected = {"inputs": batch(), "expected": outputs_of(model, encoderstack.EncoderStackModel)}
        torch.save(expected, tmp_path / f"expected{index}.pt")
        arguments += [str(tmp_path / f"checkpoint{index}"), "AutoModel", str(tmp_path / f"expected{index}.pt")]
    stdout = load_as_remote_code(tmp_path, arguments)
    loaded = [line.split()[-2:] for line in stdout.splitlines() if line.startswith("remote load ok")]
    assert loaded == [[fields["norm_placement"], fields.get("norm_type", "layernorm")] for fields in cases]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_activation_checkpointing_gives_the_same_gradients(placement):
    inputs = batch()
    grads = []
    for checkpointing in (False, True):
        model = build(encoderstack.EncoderStackForMaskedLM, norm_placement=placement).train()
        if checkpointing:
            model.activation_checkpointing_enable()
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
        model(**inputs, labels=labels).loss.backward()
        grads.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=0, msg=name)

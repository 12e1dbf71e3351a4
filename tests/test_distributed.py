"""Data-parallel fine-tuning on the engines users run (torchrun, accelerate launch; gloo on CPU) gives every rank
the same weights, equal to one process on the same global batch; pre-training runs under torchrun too."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from conftest import tiny_model_folder
from safetensors.torch import load_file

HERE = Path(__file__).parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny") / "model"
    return tiny_model_folder(folder, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(command, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(HERE), *sys.path])}
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return result.stdout


def training_losses(folder) -> dict[int, float]:
    """rank -> the training loss it wrote"""
    return {int(path.stem.removeprefix("loss")): json.loads(path.read_text()) for path in folder.glob("loss*.json")}


def assert_same_weights(actual, expected):
    assert actual.keys() == expected.keys()
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], atol=1e-6, rtol=0, msg=key)


def test_two_torchrun_ranks_end_with_identical_weights_equal_to_one_process(tiny, tmp_path):
    script = str(HERE / "distributed_train.py")
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    launch([sys.executable, script, str(tiny), str(tmp_path / "one"), "8"], tmp_path)
    launch([*TORCHRUN, script, str(tiny), str(tmp_path / "two"), "4"], tmp_path)
    single = load_file(tmp_path / "one" / "rank0.safetensors")
    rank0, rank1 = (load_file(tmp_path / "two" / f"rank{r}.safetensors") for r in (0, 1))
    for key in rank0:
        assert torch.equal(rank0[key], rank1[key]), key
    assert_same_weights(rank0, single)
    initial = load_file(tmp_path / "one" / "initial.safetensors")  # the weights training started from
    assert initial.keys() == single.keys()
    assert [key for key in initial if torch.equal(single[key], initial[key])] == []  # every tensor trained
    assert (single["classifier.weight"] - initial["classifier.weight"]).abs().max() > 1e-3


def test_fsdp_full_shard_trains_each_rank_on_its_half_of_the_global_batch_of_one_process(tiny, tmp_path):
    """The ranks' weights are sharded, so their losses are the check: each rank's mean loss over its own half-batches,
    and the two averaged, equal one process's mean over the same global batches (same updates, every step)."""
    script = str(HERE / "distributed_train.py")
    (tmp_path / "one").mkdir()
    launch([sys.executable, script, str(tiny), str(tmp_path / "one"), "8"], tmp_path)
    launch([*TORCHRUN, script, str(tiny), str(tmp_path), "4", "fsdp"], tmp_path)
    single, sharded = training_losses(tmp_path / "one"), training_losses(tmp_path)
    assert sorted(sharded) == [0, 1] and sharded[0] != sharded[1]  # each rank saw its own rows
    assert (sharded[0] + sharded[1]) / 2 == pytest.approx(single[0], abs=1e-6)


def test_the_finetune_command_under_accelerate_launch_equals_one_process(tiny, tmp_path):
    data = HERE.parent / "src" / "encoderstack" / "data" / "sentiment"
    # Plain SGD: Adam turns float-level gradient noise on near-zero coordinates into whole lr-sized steps. And 320
    # training rows = 20 global batches of 16: with a ragged last batch, DDP would repeat samples to even it out.
    common = [
        "finetune",
        "--model",
        str(tiny),
        "--train",
        str(data / "train.csv"),
        "--eval",
        str(data / "dev.csv"),
        "--epochs",
        "1",
        "--optim",
        "sgd",
        "--lr",
        "0.5",
    ]
    launch([sys.executable, "-m", "encoderstack", *common, "--batch-size", "16", "--output", "one"], tmp_path)
    # --multi_gpu is accelerate's torchrun-based launcher; on a machine without GPUs it runs gloo on the CPU
    # (--cpu would pick its single-process launcher).
    launch(
        [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            "2",
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(free_port()),
            "-m",
            "encoderstack",
            *common,
            "--batch-size",
            "8",
            "--output",
            "two",
        ],
        tmp_path,
    )
    assert_same_weights(
        load_file(tmp_path / "two" / "model.safetensors"), load_file(tmp_path / "one" / "model.safetensors")
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]


def test_the_pretrain_command_under_torchrun_trains_on_two_ranks_and_writes_one_loadable_model(tiny, tmp_path):
    from encoderstack.diagnostics.corpus import stdlib_corpus

    corpus = stdlib_corpus(tmp_path / "stdlib.txt", max_bytes=6_000)
    config = "hidden_size=32,num_hidden_layers=2,num_attention_heads=4,intermediate_size=64,max_position_embeddings=64"
    launch(
        [
            *TORCHRUN,
            "-m",
            "encoderstack",
            "pretrain",
            "--config",
            config,
            "--tokenizer",
            str(tiny),
            "--train",
            str(corpus),
            "--output",
            "two",
            "--max-length",
            "32",
            "--max-steps",
            "4",
            "--batch-size",
            "4",
            "--lr",
            "1e-3",
            "--seed",
            "0",
        ],
        tmp_path,
    )
    record = json.loads((tmp_path / "two" / "pretrain.json").read_text())
    assert record["world_size"] == 2 and record["steps"] == 4
    assert record["trained_tokens"] > 2 * 4 * 4  # both ranks' tokens: 4 steps of 2 x 4 sequences of a few tokens
    assert record["eval_loss_after"] < record["eval_loss_before"]
    assert transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "two").config.num_hidden_layers == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stdlib.txt", "two"]  # no caches or checkpoints left

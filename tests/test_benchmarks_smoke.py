"""Every benchmark script runs end to end on the tests' tiny model for one round, so that none of them can rot. No
timing is asserted: the scripts print ratios for people to read."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_config

ROOT = Path(__file__).resolve().parent.parent
BERT_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "intermediate_size",
    "max_position_embeddings",
)
TINY = json.dumps({name: getattr(tiny_config(), name) for name in BERT_FIELDS})
ONE_ROUND = ["--models", TINY, "--iterations", "1"]
RUNS = {
    "inference.py": [*ONE_ROUND, "--sizes", "2x16", "--peak-size", "64"],
    "training.py": [*ONE_ROUND, "--sizes", "2x16", "--peak-size", "64"],
    "convert.py": [*ONE_ROUND, "--clock", "cpu"],
    "attention.py": [*ONE_ROUND, "--sizes", "2x16"],
    "deployment.py": [*ONE_ROUND, "--sizes", "2x16"],
    "sparse_mlm.py": [*ONE_ROUND, "--sizes", "2x16"],
    # real text: the tokenizer's ids need the real vocabulary
    "pretrain.py": [
        "--models",
        json.dumps({**json.loads(TINY), "vocab_size": 30522}),
        "--iterations",
        "1",
        "--sizes",
        "2x16",
        "--batches",
        "2",
        "--corpus-bytes",
        "4000",
    ],
}


@pytest.mark.parametrize("script", RUNS)
def test_the_benchmark_runs_on_a_tiny_model_and_prints_its_table_and_the_command(script):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *RUNS[script]],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(line.startswith("model ") for line in lines), result.stdout
    assert lines[-1].startswith(f"reproduce: python benchmarks/{script} --models"), lines[-1]

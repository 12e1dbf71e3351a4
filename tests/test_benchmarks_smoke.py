"""Every benchmark script runs end to end on the tests' tiny model for one round, so that none of them can rot. No
timing is asserted: the scripts print ratios for people to read."""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import tiny_config

import encoderstack

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
    "training.py": [*ONE_ROUND, "--sizes", "2x16", "--peak-size", "64", "--autocast", "bfloat16"],
    "convert.py": [*ONE_ROUND, "--clock", "cpu"],
    "load.py": [*ONE_ROUND, "--clock", "cpu"],
    "attention.py": [*ONE_ROUND, "--sizes", "2x16"],
    "flex.py": [*ONE_ROUND, "--sizes", "2x16"],
    "deployment.py": [*ONE_ROUND, "--sizes", "2x16"],
    "cpu_attention.py": [*ONE_ROUND, "--sizes", "2x16"],
    "prepacked.py": [*ONE_ROUND, "--sizes", "2x16"],
    "sparse_mlm.py": [*ONE_ROUND, "--sizes", "2x16"],
    "families.py": [*ONE_ROUND, "--sizes", "2x16", "--families", "roberta,electra,distilbert,modernbert"],
    "sliding_window.py": [
        *ONE_ROUND,
        "--quick",
        "--sizes",
        "1x64",
        "--radius",
        "4",
        "--parts",
        "a,b,c",
        "--long-lengths",
        "96",
    ],
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


def run_script(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, f"benchmarks/{script}", *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.parametrize("script", RUNS)
def test_the_benchmark_runs_on_a_tiny_model_and_prints_its_table_and_the_command(script):
    result = run_script(script, *RUNS[script])
    lines = result.stdout.splitlines()
    assert any(line.startswith("model ") for line in lines), result.stdout
    assert lines[-1].startswith(f"reproduce: python benchmarks/{script} --models"), lines[-1]


def test_cpu_attention_s_layer_table_times_each_kernel_this_cpu_and_torch_can_run():
    result = run_script("cpu_attention.py", *ONE_ROUND, "--sizes", "2x16", "--layer")
    rows = [line.split() for line in result.stdout.splitlines() if line.split()[1:2] in (["bfloat16"], ["float32"])]
    assert len(rows) == 14, result.stdout  # 2x16 and single sequences of 64 to 256 tokens, in bf16 and float32
    plan = encoderstack.execution_encoderstack
    for row in rows:
        gemms = plan.BF16_GEMMS and row[1] == "bfloat16"
        assert row.count("ms") == 1 + gemms + plan.ONEDNN_GRAPH, row  # SDPA's time, and each other kernel's


def run_gpu_check(*arguments):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "benchmarks/gpu_check.py", "--smoke", *arguments]
    return subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


def test_the_gpu_check_runs_every_section_in_its_cpu_smoke_mode_and_passes():
    result = run_gpu_check()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for section in ("## plan table", "## bf16 parity", "## host syncs", "## benchmarks"):
        assert section in result.stdout
    assert result.stdout.rstrip().endswith("all passed")


def test_the_gpu_check_stops_at_its_time_guard(monkeypatch, capsys):
    """A section that hangs (here: sleeps past the budget) is cut by the alarm, whatever the machine's speed."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    gpu_check = importlib.import_module("gpu_check")
    monkeypatch.setattr(gpu_check, "plan_table", lambda args: time.sleep(30))
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--smoke", "--budget", "1"])
    started, alarm = time.monotonic(), signal.getsignal(signal.SIGALRM)
    with pytest.raises(SystemExit) as exit:
        gpu_check.main()
    signal.signal(signal.SIGALRM, alarm)
    assert exit.value.code == 1 and time.monotonic() - started < 10
    output = capsys.readouterr().out
    assert "stopped by the time guard" in output and "FAILED: time guard" in output


def test_the_gpu_depth_sweep_runs_its_smoke_grid_on_cpu_and_writes_its_report(tmp_path):
    out = tmp_path / "sweep"
    result = run_script("depth_sweep_gpu.py", "--smoke", "--out", str(out))

    records = json.loads((out / "results.json").read_text())["records"]
    assert [(r["placement"], r["run"]) for r in records] == [
        (placement, run) for placement in ("post", "deepnorm") for run in ("init", "trained", "trained")
    ]
    assert "every run of the grid" in (out / "index.md").read_text()
    assert result.stdout.splitlines()[-1].startswith(f"wrote {out / 'index.md'}")


def test_the_training_step_s_useful_flops_count_the_mlm_head_on_labelled_tokens_only(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    training = importlib.import_module("training")
    config = tiny_config()
    encoder = training.step_flops("classification", config, [10, 6], labelled=0)
    head = 2 * (config.hidden_size**2 + config.hidden_size * config.vocab_size)
    assert training.step_flops("mlm", config, [10, 6], labelled=3) == encoder + 3 * 3 * head

"""Conversion cost: time and peak memory of `encoderstack.convert(..., verify=False)` on bert-base- and
bert-large-sized checkpoints (random weights, written here with BertForMaskedLM.save_pretrained), against reading
the same file (every byte, into memory: safetensors' load_file alone only maps it). Each operation runs alone in a
fresh child process; memory is that process's RSS high-water mark (VmHWM) minus its RSS before the operation (after
the imports).

    python benchmarks/convert.py                      # bert-base and bert-large, 3 rounds each
    python benchmarks/convert.py --models bert-base --iterations 1

Targets: peak added memory at most 1.5x the checkpoint size; time at most 3x reading the file.
"""

import json
import os
import shutil
import statistics
import subprocess
import sys

import common
import torch
from common import transformers

CHILD = r"""
import json, sys, time
operation, source, output, clock = sys.argv[1:]
clock = time.process_time if clock == "cpu" else time.perf_counter

def rss(field):
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(field + ":"))

import encoderstack
before = rss("VmRSS")
start = clock()
if operation == "read":
    with open(source + "/model.safetensors", "rb") as file:
        data = file.read()
else:
    encoderstack.convert(source, output, verify=False)
seconds = clock() - start
print(json.dumps({"seconds": seconds, "added": rss("VmHWM") - before, "peak": rss("VmHWM")}))
"""


def run_child(operation, source, output, clock):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD, operation, str(source), str(output), clock],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if result.returncode != 0:
        raise SystemExit(f"{operation} failed:\n{result.stderr[-3000:]}")
    shutil.rmtree(output, ignore_errors=True)
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = common.common_arguments(__doc__.splitlines()[0], sizes="", models="bert-base,bert-large")
    args = parser.parse_args()
    if args.quick:
        args.models = "bert-base"
    iterations = args.iterations or (1 if args.quick else 3)
    clock = "CPU time (all threads)" if args.clock == "cpu" else "wall clock"
    print(
        f"conversion: {os.cpu_count()} cores, {clock}, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; {iterations} interleaved rounds, medians"
    )
    rows = []
    for spec in common.parse_models(args.models):
        with common.scratch_folder() as folder:
            source, output = os.path.join(folder, "bert"), os.path.join(folder, "encoderstack")
            torch.manual_seed(0)
            transformers.BertForMaskedLM(common.bert_config(spec)).save_pretrained(source)
            size = os.path.getsize(os.path.join(source, "model.safetensors"))
            runs = {"read": [], "convert": []}
            for _ in range(iterations):
                for operation in runs:
                    runs[operation].append(run_child(operation, source, output, args.clock))
        read, convert = (
            {key: statistics.median(run[key] for run in runs[op]) for key in ("seconds", "added", "peak")}
            for op in ("read", "convert")
        )
        rows.append(
            [
                common.model_name(spec),
                f"{size / 2**20:.0f} MiB",
                f"{read['seconds']:.2f} s",
                f"{read['added'] / 2**20:.0f} MiB ({read['added'] / size:.2f}x)",
                f"{convert['seconds']:.2f} s ({convert['seconds'] / read['seconds']:.2f}x)",
                f"{convert['added'] / 2**20:.0f} MiB ({convert['added'] / size:.2f}x)",
                f"{convert['peak'] / 2**20:.0f} MiB",
            ]
        )
    common.print_table(
        rows,
        [
            "model",
            "checkpoint",
            "read time",
            "read memory",
            "convert time (/ read)",
            "convert memory (/ checkpoint)",
            "convert peak RSS",
        ],
    )
    print("memory: RSS high-water mark minus RSS before the operation (after importing torch and transformers)")
    print(f"reproduce: {common.command_line()}")


if __name__ == "__main__":
    main()

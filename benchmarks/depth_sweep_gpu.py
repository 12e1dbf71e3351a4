"""The placement sweep of `encoderstack diagnose --corpus stdlib --sweep` (docs/diagnostics/depth) sized for one
H100/H200: four times as wide (hidden 256, 4 heads), twice the batch, and a third learning rate, 1e-3, beside the
CPU grid's 1e-2 and 1e-1; 24 layers, post/pre/deepnorm/lns, with and without warm-up, three seeds, 20 steps a run.

These models are small enough that a GPU step costs kernel launches more than arithmetic (the CPU path's attention
runs one sequence at a time), so the grid was sized from an estimate, not a measurement (no GPU was available):
about 0.25 s a step, 7 s a run with its measurements, 84 records in about 8 minutes. A time guard inside the sweep
holds the limit whatever the real speed: no run starts after `--budget-minutes` (default 7) and a run the guard cuts
short is left out, so the script, data preparation and report included, ends within 8 minutes; a cut-short grid
still writes its report (seed-major order: whole seeds first) and says how much of the grid it covers.

    python benchmarks/depth_sweep_gpu.py --out docs/diagnostics/depth-gpu     # on the GPU machine
    python benchmarks/depth_sweep_gpu.py --smoke --out /tmp/sweep              # the same code on CPU, in seconds

The Trainer puts the model on the GPU when there is one; nothing else here is GPU-specific.
"""

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from encoderstack.diagnostics.corpus import stdlib_corpus  # noqa: E402
from encoderstack.diagnostics.sweep import SweepSettings, run_sweep  # noqa: E402

GPU_GRID = SweepSettings(
    corpus="stdlib",
    placements=("post", "pre", "deepnorm", "lns"),
    layers=(24,),
    lrs=(1e-3, 1e-2, 1e-1),
    seeds=3,
    steps=20,
    hidden_size=256,
    heads=4,
    batch_size=32,
    budget_minutes=7.0,
)
SMOKE_CORPUS_BYTES = 12_000


def smoke_grid(corpus: Path) -> SweepSettings:
    """The GPU grid's code path at its smallest: two placements, one rate, with and without warm-up, one seed."""
    return SweepSettings(
        corpus=str(corpus),
        placements=("post", "deepnorm"),
        layers=(2,),
        lrs=(1e-2,),
        seeds=1,
        steps=2,
        hidden_size=16,
        heads=2,
        budget_minutes=1.0,
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="the report folder (must not exist, unless --force)")
    parser.add_argument("--smoke", action="store_true", help="a tiny grid on a small corpus, for CPU: seconds")
    parser.add_argument("--budget-minutes", type=float, default=GPU_GRID.budget_minutes, help="the time guard")
    parser.add_argument("--force", action="store_true", help="replace an existing report folder")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("depth_sweep_gpu: no CUDA device; run with --smoke on CPU", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        if args.smoke:
            settings = smoke_grid(stdlib_corpus(Path(scratch) / "stdlib.txt", max_bytes=SMOKE_CORPUS_BYTES))
        else:
            settings = SweepSettings(**{**GPU_GRID.__dict__, "budget_minutes": args.budget_minutes})
        print(settings.command, flush=True)
        folder = run_sweep(args.out, settings, force=args.force, progress=lambda line: print(line, flush=True))
    print(f"wrote {folder / 'index.md'} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

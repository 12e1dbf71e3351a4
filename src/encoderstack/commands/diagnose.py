"""`encoderstack diagnose`: the report of `run_report` from the command line."""

import argparse
import dataclasses
import sys
import time

from encoderstack_cli import COMMANDS

from ..configuration_encoderstack import NORM_PLACEMENTS
from ..diagnostics.corpus import STDLIB
from ..diagnostics.report import QUICK, ReportSettings, run_report
from ..diagnostics.sweep import SweepSettings, run_sweep
from ..output_folder import OutputFolderError
from ..training import TrainingError
from . import non_negative_int, positive_float, positive_int

DEFAULT_OUTPUT = "encoderstack-diagnostics"


def depth_list(text: str) -> tuple[int, ...]:
    try:
        depths = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer counts, got {text!r}") from None
    if any(depth < 1 for depth in depths):
        raise argparse.ArgumentTypeError(f"layer counts must be positive, got {text!r}")
    return depths


def rate_list(text: str) -> tuple[float, ...]:
    return tuple(positive_float(part) for part in text.split(","))


def placement_list(text: str) -> tuple[str, ...]:
    placements = tuple(text.split(","))
    unknown = [name for name in placements if name not in NORM_PLACEMENTS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown placement {unknown[0]!r}; choose from {','.join(NORM_PLACEMENTS)}")
    return placements


def model_width(text: str) -> int:
    width = positive_int(text)
    if width % 8:
        raise argparse.ArgumentTypeError(
            f"expected a multiple of 8 (4 heads of even size, for rotary positions), got {width}"
        )
    return width


def add_diagnose_command(commands) -> argparse.ArgumentParser:
    """Register `diagnose` on the `add_subparsers()` object of the `encoderstack` parser."""
    full, quick = ReportSettings(), QUICK
    diagnose = commands.add_parser(
        "diagnose",
        help=COMMANDS["diagnose"],
        description="Gradient norms, activation scale and layer similarity at init, and a short training run with "
        "and without warm-up, for each placement and depth; writes OUT/index.md with PNG figures.",
    )
    diagnose.add_argument(
        "--layers",
        type=depth_list,
        help=f"comma-separated depths (default {','.join(map(str, full.layers))}; "
        f"--quick: {','.join(map(str, quick.layers))})",
    )
    diagnose.add_argument(
        "--placements",
        type=placement_list,
        help="comma-separated placements (default: every row of the placement table once, so not peri, "
        "which is sandwich)",
    )
    diagnose.add_argument(
        "--steps", type=positive_int, help=f"training steps per run (default {full.steps}; --quick: {quick.steps})"
    )
    diagnose.add_argument(
        "--hidden-size",
        type=model_width,
        help=f"model width, a multiple of 8 (default {full.hidden_size}; --quick: {quick.hidden_size})",
    )
    diagnose.add_argument("--lr", type=positive_float, help=f"peak learning rate (default {full.lr:g})")
    diagnose.add_argument("--seed", type=int, help=f"seed of every initialization and batch (default {full.seed})")
    diagnose.add_argument(
        "--warmup-steps",
        dest="warmup",
        type=non_negative_int,
        help="linear warm-up of the warm-up runs, in steps (default: a fifth of --steps)",
    )
    diagnose.add_argument(
        "--corpus",
        metavar="TEXT",
        help=f"train on real text through pretrain's data path: a .txt/.jsonl file or folder, as "
        f"pretrain --train takes, or '{STDLIB}' (the installed Python's docstrings)",
    )
    sweep = SweepSettings()
    diagnose.add_argument(
        "--sweep",
        action="store_true",
        help="with --corpus: the learning-rate, warm-up and seed grid of deep, narrow stacks (defaults: "
        f"--layers {','.join(map(str, sweep.layers))} --placements {','.join(sweep.placements)} --steps "
        f"{sweep.steps} --hidden-size {sweep.hidden_size}); divergence rate, eval loss, gradient norm and layer "
        "redundancy over depth",
    )
    diagnose.add_argument(
        "--lrs",
        type=rate_list,
        help=f"--sweep: comma-separated peak learning rates (default {','.join(f'{lr:g}' for lr in sweep.lrs)})",
    )
    diagnose.add_argument(
        "--seeds", type=positive_int, help=f"--sweep: seeds per cell, from --seed on (default {sweep.seeds})"
    )
    diagnose.add_argument("--heads", type=positive_int, help=f"--sweep: attention heads (default {sweep.heads})")
    diagnose.add_argument(
        "--batch-size",
        dest="batch_size",
        type=positive_int,
        help=f"--sweep: training sequences per step (default {sweep.batch_size})",
    )
    diagnose.add_argument(
        "--init-std",
        dest="init_std",
        type=positive_float,
        help="--sweep: initializer_range (default hidden-size ** -0.5, a square projection's Xavier std)",
    )
    diagnose.add_argument(
        "--budget-minutes",
        dest="budget_minutes",
        type=positive_float,
        help="--sweep: start no run after this much wall clock; the report covers the runs done",
    )
    diagnose.add_argument("--out", default=DEFAULT_OUTPUT, help=f"report folder (default ./{DEFAULT_OUTPUT})")
    diagnose.add_argument("--quick", action="store_true", help="small depths and few steps: about a minute")
    diagnose.add_argument("--force", action="store_true", help="replace an existing report folder")
    diagnose.set_defaults(run=diagnose_command, reads=("corpus",), writes="out")
    return diagnose


SWEEP_ONLY = ("lrs", "seeds", "heads", "batch_size", "init_std", "budget_minutes")
NOT_IN_SWEEP = ("lr", "quick")


def given_settings(args, settings_class) -> dict:
    return {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(settings_class)
        if getattr(args, field.name, None) is not None
    }


def option_conflict(args) -> str | None:
    def flag(name):
        return "--" + name.replace("_", "-")

    if not args.sweep:
        given = [name for name in SWEEP_ONLY if getattr(args, name) is not None]
        return f"{flag(given[0])} needs --sweep" if given else None
    if args.corpus is None:
        return "--sweep needs --corpus (a text file or folder, or 'stdlib')"
    given = [name for name in NOT_IN_SWEEP if getattr(args, name) not in (None, False)]
    return f"{flag(given[0])} does not apply to --sweep (give --lrs for its learning rates)" if given else None


def diagnose_command(args) -> int:
    if conflict := option_conflict(args):
        print(f"encoderstack: error: {conflict}", file=sys.stderr)
        return 2
    try:
        if args.sweep:
            settings, run = SweepSettings(**given_settings(args, SweepSettings)), run_sweep
        else:
            defaults = QUICK if args.quick else ReportSettings()
            settings, run = dataclasses.replace(defaults, **given_settings(args, ReportSettings)), run_report
    except ValueError as error:
        print(f"encoderstack: error: {error}", file=sys.stderr)
        return 2
    print(settings.command)
    start = time.perf_counter()
    try:
        folder = run(args.out, settings, force=args.force, progress=print)
    except (OutputFolderError, TrainingError, ImportError) as error:
        print("encoderstack: error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2
    print(f"wrote {folder / 'index.md'} in {time.perf_counter() - start:.0f} s")
    return 0

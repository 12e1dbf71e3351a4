"""The `encoderstack` console script. It lies outside the package because importing `encoderstack` registers the Auto
classes (torch and transformers: seconds): `--version` and the top-level help answer from here, and a command imports
what it needs when it runs (its parser and code: `encoderstack.cli`)."""

import argparse
import importlib.util
import sys
from pathlib import Path

DESCRIPTION = """EncoderStack: BERT's encoder stack with the normalization placement as a config choice. Convert a BERT
checkpoint (folder, Hub id or Google TensorFlow release; by default the embedded all-MiniLM-L6-v2) and verify it against
transformers, fine-tune or pre-train it, export it back to BERT, to ONNX or to OpenVINO, write its model card and push
it to the Hub, and diagnose how each normalization placement trains."""

COMMANDS = {  # each command's line in the top-level help
    "convert": "convert a BERT checkpoint and verify parity with BertModel",
    "finetune": "fine-tune with transformers' Trainer (works under torchrun)",
    "pretrain": "masked-LM pre-training, fresh or continued, on packed sequences",
    "export-bert": "turn a post-LN EncoderStack folder back into a BERT folder",
    "export-onnx": "export to ONNX Runtime's format through transformers.exporters (padded path) and verify it there",
    "export-openvino": "export to OpenVINO's format through transformers.exporters (padded path) and verify it there",
    "card": "write the model card (README.md) of an EncoderStack folder",
    "push": "check an EncoderStack folder, then publish it to the Hub in one commit",
    "diagnose": "measure, plot and train each normalization placement at several depths",
}


def package_version() -> str:
    """`encoderstack/version.py`'s `__version__`, read without importing the package."""
    package = Path(importlib.util.find_spec("encoderstack").submodule_search_locations[0])
    spec = importlib.util.spec_from_file_location("encoderstack_version", package / "version.py")
    version = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(version)
    return version.__version__


def top_parser(parser_class: type = argparse.ArgumentParser):
    """The `encoderstack` parser without its commands' parsers: (parser, the subparsers to add them to)."""
    parser = parser_class(prog="encoderstack", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    return parser, parser.add_subparsers(dest="command", required=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in COMMANDS:
        from encoderstack.cli import main as run_command

        return run_command(argv)
    parser, commands = top_parser()
    for name, help in COMMANDS.items():
        commands.add_parser(name, help=help)
    parser.parse_args(argv)  # --help and --version print and exit; anything else is argparse's error (exit 2)
    return 2


if __name__ == "__main__":
    sys.exit(main())

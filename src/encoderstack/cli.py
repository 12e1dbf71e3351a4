"""The `encoderstack` command's parsers and what each command runs (the console script, `encoderstack_cli`, hands
every command over to `main` here)."""

import argparse
import functools
import json
import sys

from transformers import HfArgumentParser

from encoderstack_cli import COMMANDS, top_parser

from .commands import DEFAULT_OUTPUT, embedded_default

EMBEDDED_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def parity_table(parity: dict) -> str:
    from .parity import parity_rows

    backends, rows = parity_rows(parity, missing="-")
    width = max(len(name) for name, _ in rows) + 2
    lines = [
        f"max |EncoderStack - {parity['reference']}| on real tokens ({parity['inputs']})",
        f"{'output':<{width}}" + "".join(f"{b:>12}" for b in backends),
    ]
    for name, cells in rows:
        lines.append(f"{name:<{width}}" + "".join(f"{cell:>12}" for cell in cells))
    rows = [row for results in parity["results"].values() for row in results]
    if "min_cosine" in parity:  # a bf16 export, checked by direction
        ok = all(row["min_cosine"] >= parity["min_cosine"] for row in rows)
        worst = min(row["min_cosine"] for row in rows)
        verdict = "OK" if ok else "FAILED"
        lines.append(f"parity {verdict} in bf16 (min cosine {worst:.5f}, threshold {parity['min_cosine']})")
    else:
        ok = all(row["max_abs_diff"] <= parity["tolerance"] for row in rows)
        lines.append(f"parity {'OK' if ok else 'FAILED'} (tolerance {parity['tolerance']:g})")
    return "\n".join(lines)


def convert_command(args) -> int:
    from . import convert

    source = args.source if args.source is not None else embedded_default()
    output = args.output if args.output is not None else DEFAULT_OUTPUT
    folder = convert(
        source,
        output,
        source_hub_id=EMBEDDED_HUB_ID if args.source is None else None,
        task=args.task,
        verify=not args.no_verify,
        force=args.force,
        gelu=args.gelu,
        lowercase=args.lowercase,
    )
    report = json.loads((folder / "conversion.json").read_text())
    print(f"converted {source} -> {folder}")
    print(
        f"  {report['source_architecture'] or 'BERT'} -> {report['encoderstack_class']} "
        f"(norm_placement={report['norm_placement']}), {len(report['mapped'])} tensors mapped, "
        f"{len(report['skipped'])} skipped, {len(report['initialized'])} newly initialized"
    )
    for note in ("gelu", "tokenizer"):
        if note in report:
            print(f"  {note}: {report[note]}")
    by_reason = {}
    for key, reason in report["skipped"].items():
        by_reason.setdefault(reason, []).append(key)
    for reason, keys in by_reason.items():
        more = f" and {len(keys) - 1} more (listed in conversion.json)" if len(keys) > 1 else ""
        print(f"  skipped {keys[0]}{more}: {reason}")
    if "parity" in report:
        print(parity_table(report["parity"]))
    return 0


def export_command(args) -> int:
    from . import export_bert

    folder = export_bert(args.source, args.output, force=args.force)
    print(f"exported {args.source} -> {folder} (a plain BERT checkpoint)")
    return 0


def quantization_table(quantization: dict, runtime: str) -> str:
    lines = [f"int8 ({quantization['folder']}/) against float32 in {runtime} ({quantization['inputs']})"]
    for row in quantization["results"]:
        agreement = f", argmax agreement {row['argmax_agreement']:.1%}" if "argmax_agreement" in row else ""
        lines.append(f"  {row['output']}: cosine min {row['min_cosine']:.4f}, mean {row['mean_cosine']:.4f}{agreement}")
    verdict = "OK" if quantization["accepted"] else "BELOW THRESHOLD, kept by --force"
    lines.append(f"int8 {verdict} (min cosine {quantization['min_cosine']:.4f}, threshold {quantization['threshold']})")
    return "\n".join(lines)


def exported_command(args) -> int:
    from .exporters import RECORD, export

    options = {"opset": args.opset} if args.format == "onnx" else {"precision": args.precision}
    folder = export(
        args.model,
        args.output,
        args.format,
        task=args.task,
        quantize=args.quantize,
        verify=not args.no_verify,
        force=args.force,
        **options,
    )
    record = json.loads((folder / RECORD).read_text())
    print(f"exported {args.model} -> {folder} ({record['runtime']}; ExportedModel.from_pretrained loads it)")
    opset = f"opset {record['opset']}, " if "opset" in record else ""
    print(
        f"  {record['encoderstack_class']} (norm_placement={record['norm_placement']}), {opset}"
        f"{record['graph']}; outputs: {', '.join(record['outputs'])}"
    )
    if "parity" in record:
        print(parity_table(record["parity"]))
    if "quantization" in record:
        print(quantization_table(record["quantization"], record["runtime"]))
    return 0


def add_export_command(commands, format_name: str, runtime: str, quantizer: str) -> None:
    """`export-onnx` and `export-openvino`: the same options (ONNX's opset aside), one function behind them."""
    from .conversion.keymap import TASK_CHOICES

    command = commands.add_parser(f"export-{format_name}", help=COMMANDS[f"export-{format_name}"])
    command.add_argument("model", help="EncoderStack folder")
    command.add_argument("output", help="output folder (what transformers' ExportedModel.from_pretrained loads)")
    command.add_argument("--task", choices=TASK_CHOICES, help="head to load (default: the folder's architecture)")
    if format_name == "onnx":
        command.add_argument("--opset", type=int, help="ONNX opset, 18 to 25 (default: torch.onnx's)")
    else:
        command.add_argument(
            "--precision",
            choices=["f32", "bf16"],
            default="f32",
            help="the precision OpenVINO runs at, recorded and verified (bf16 needs AVX-512 BF16 or AMX, else f32 "
            "runs); a plain ExportedModel.from_pretrained runs at OpenVINO's CPU default, bf16 where the CPU has it",
        )
    command.add_argument("--quantize", choices=["int8"], help=f"also write OUTPUT/int8/ ({quantizer})")
    command.add_argument("--no-verify", action="store_true", help=f"skip the {runtime} parity check")
    command.add_argument(
        "--force", action="store_true", help="replace an existing output folder; keep an int8 model below cosine 0.99"
    )
    command.set_defaults(run=exported_command, format=format_name, reads=("model",), writes="output")


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except a default that says nothing (None, a flag's False) or one
    the help already puts in words."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class TwoNamesForOneSetting(Exception):
    """`--output a --output_dir b`: argparse would keep the last one without a word."""


class OneNamePerSetting(argparse.Action):
    """Mixed into every option's action: the first option string that set a destination is the only one allowed
    (the same option given twice is argparse's usual last-one-wins)."""

    def __call__(self, parser, namespace, values, option_string=None):
        first = parser.names_given.setdefault(self.dest, option_string)
        if first != option_string:
            raise TwoNamesForOneSetting(f"{first} and {option_string} both set {self.dest}; give one")
        super().__call__(parser, namespace, values, option_string)


class Parser(HfArgumentParser):
    """`add_subparsers` makes every subcommand's parser of this class too, so that each help shows the defaults, and
    a subcommand's `dataclass_types` (transformers' `HfArgumentParser`) become its options, each settable under one
    of its names only (`OneNamePerSetting`)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsShown)
        self.names_given = {}
        super().__init__(*args, **kwargs)

    def _add_action(self, action):
        if action.option_strings and action.dest is not argparse.SUPPRESS:
            action.__class__ = one_name_per_setting(type(action))
        return super()._add_action(action)

    def parse_known_args(self, args=None, namespace=None):
        self.names_given = {}
        return super().parse_known_args(args, namespace)


@functools.cache
def one_name_per_setting(action_class: type) -> type:
    return type(action_class.__name__, (OneNamePerSetting, action_class), {})


def build_parser() -> argparse.ArgumentParser:
    from .commands.diagnose import add_diagnose_command
    from .commands.hub import add_hub_commands
    from .commands.training import add_training_commands
    from .conversion.keymap import TASK_CHOICES

    parser, commands = top_parser(Parser)

    convert = commands.add_parser("convert", help=COMMANDS["convert"])
    convert.add_argument("source", nargs="?", help="BERT folder or Hub id (default: the embedded all-MiniLM-L6-v2)")
    convert.add_argument("output", nargs="?", help=f"output folder (default: ./{DEFAULT_OUTPUT})")
    convert.add_argument("--task", choices=TASK_CHOICES, help="head to convert to (default: from the checkpoint)")
    convert.add_argument("--no-verify", action="store_true", help="skip the parity check against transformers")
    convert.add_argument("--force", action="store_true", help="replace an existing output folder")
    google = convert.add_argument_group("Google TensorFlow checkpoints")
    google.add_argument(
        "--gelu",
        choices=["tanh", "erf"],
        default="tanh",
        help="tanh: reproduce the original model (default); erf: transformers' historical conversion",
    )
    casing = google.add_mutually_exclusive_group()
    casing.add_argument(
        "--lowercase",
        dest="lowercase",
        action="store_true",
        default=None,
        help="the vocab.txt tokenizer lower-cases (default: from the folder name, uncased/cased)",
    )
    casing.add_argument("--cased", dest="lowercase", action="store_false", help="the vocab.txt tokenizer keeps case")
    # reads: every path argument the command reads, all given to its OutputFolder as inputs; writes: its output
    # folder (tests/test_inputs_are_never_outputs.py runs each of the first as the second)
    convert.set_defaults(run=convert_command, reads=("source",), writes="output")

    add_training_commands(commands)

    export = commands.add_parser("export-bert", help=COMMANDS["export-bert"])
    export.add_argument("source", help="post-LN EncoderStack folder")
    export.add_argument("output", help="output folder (a BERT checkpoint)")
    export.add_argument("--force", action="store_true", help="replace an existing output folder")
    export.set_defaults(run=export_command, reads=("source",), writes="output")
    add_export_command(commands, "onnx", "ONNX Runtime", "SmoothQuant, then ONNX Runtime's dynamic int8")
    add_export_command(commands, "openvino", "OpenVINO", "NNCF's post-training int8")
    add_hub_commands(commands)
    add_diagnose_command(commands)
    return parser


def negative_numbers_attached(argv: list[str]) -> list[str]:
    """`--lr -1e-4` as `--lr=-1e-4`: argparse (Python 3.11's, at least) takes a negative number in scientific
    notation for an option name and says only "expected one argument"; attached, the value reaches the option's
    type, whose message says what is wrong with it."""
    attached = []
    for token in argv:
        previous = attached[-1] if attached else ""
        if is_negative_number(token) and previous.startswith("--") and "=" not in previous and previous != "--":
            attached[-1] = f"{previous}={token}"
        else:
            attached.append(token)
    return attached


def is_negative_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return token.startswith("-")


def main(argv=None) -> int:
    try:
        return run(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:  # every OutputFolder has removed its partial folder by now
        print("encoderstack: interrupted", file=sys.stderr)
        return 130


def run(argv: list[str]) -> int:
    try:
        args = build_parser().parse_args(negative_numbers_attached(argv))
    except TwoNamesForOneSetting as error:
        print(f"encoderstack: error: {error}", file=sys.stderr)
        return 2
    from .conversion import ConversionError
    from .conversion.tf_checkpoint import TFCheckpointError
    from .exporters import ExportError
    from .hub_card import HubError
    from .output_folder import OutputFolderError
    from .training import TrainingError

    try:
        return args.run(args)
    except (ConversionError, TFCheckpointError, TrainingError, HubError, OutputFolderError, ExportError) as error:
        print("encoderstack: error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

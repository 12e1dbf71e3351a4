"""`encoderstack finetune` and `encoderstack pretrain`: their settings are dataclasses (the command's own and
transformers' `TrainingArguments` with our defaults), turned into options by transformers' `HfArgumentParser`, so
that every `TrainingArguments` field is an option under its own name (`--bf16`, `--weight_decay`, ...)."""

import dataclasses
from pathlib import Path

from encoderstack_cli import COMMANDS

from ..finetune import FinetuneArguments, FinetuneTrainingArguments, finetune
from ..pretrain import PretrainArguments, PretrainTrainingArguments, pretrain
from . import DEFAULT_OUTPUT, embedded_default


def settings_of(args, *types) -> dict:
    """The parsed values of the fields of the dataclasses `types`."""
    names = {field.name for kind in types for field in dataclasses.fields(kind) if field.init}
    return {name: value for name, value in vars(args).items() if name in names}


def finetune_command(args) -> int:
    model = args.model
    if model is None:  # the main job's output if it is there, else the embedded BERT, converted on the fly
        model = DEFAULT_OUTPUT if Path(DEFAULT_OUTPUT).is_dir() else str(embedded_default())
    settings = settings_of(args, FinetuneArguments, FinetuneTrainingArguments)
    record = finetune(**{**settings, "model": model})
    output = args.output_dir
    print(f"fine-tuned {model} on {record['train']} ({record['train_rows']} rows) -> {output}")
    for name in (name for name in record["after"] if name != "loss"):
        print(f"  {name} on {record['eval']}: {record['before'][name]:.3f} before -> {record['after'][name]:.3f} after")
    print(f"  eval loss {record['before']['loss']:.3f} -> {record['after']['loss']:.3f}; plot: {output}/loss.png")
    return 0


def pretrain_command(args) -> int:
    record = pretrain(**settings_of(args, PretrainArguments, PretrainTrainingArguments))
    data, output = record["data"], args.output_dir
    print(
        f"pre-trained {args.model or 'a fresh model'} on {args.train} ({data['train_sequences']} sequences, "
        f"{data['train_tokens']} tokens) for {record['steps']} steps -> {output}"
    )
    if args.model is not None and record["initialized"]:
        print(f"  newly initialized (not in {args.model}): {', '.join(record['initialized'])}")
    before, after = record["before"], record["after"]
    print(
        f"  eval masked-LM loss {before['mlm_loss']:.3f} -> {after['mlm_loss']:.3f}, perplexity "
        f"{before['perplexity']:.1f} -> {after['perplexity']:.1f}, masked-token accuracy {before['accuracy']:.3f} "
        f"-> {after['accuracy']:.3f} (best step {record['best_checkpoint_step']})"
    )
    print(f"  {record['train_tokens_per_second']:,.0f} training tokens/s; plot: {output}/loss.png")
    return 0


def add_training_commands(commands) -> None:
    """`finetune` and `pretrain` on the CLI's subparsers (of class `cli.Parser`, an `HfArgumentParser`)."""
    tune = commands.add_parser(
        "finetune",
        dataclass_types=[FinetuneArguments, FinetuneTrainingArguments],
        help=COMMANDS["finetune"],
        description="Fine-tune on CSV or JSON lines; every TrainingArguments field is an option.",
    )
    # reads: every path argument the command reads, all given to its OutputFolder as inputs; writes: its output
    # folder (tests/test_inputs_are_never_outputs.py runs each of the first as the second)
    tune.set_defaults(run=finetune_command, reads=("model", "train", "eval"), writes="output_dir")
    pre = commands.add_parser(
        "pretrain",
        dataclass_types=[PretrainArguments, PretrainTrainingArguments],
        help=COMMANDS["pretrain"],
        description="Masked-LM pre-training from --model or --config; every TrainingArguments field is an option.",
    )
    pre.set_defaults(run=pretrain_command, reads=("model", "config", "tokenizer", "train", "eval"), writes="output_dir")

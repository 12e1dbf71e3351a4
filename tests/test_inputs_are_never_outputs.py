"""No command can write over, replace or delete what it reads: every path argument of every command that writes a
folder, as the real parser declares them, is run as that command's own output and as a folder that holds it."""

import argparse
import dataclasses
import hashlib
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
import transformers
from conftest import tiny_model_folder
from test_convert_bert import bert_folder

from encoderstack.cli import build_parser, main

# The arguments of the folder-writing commands that are not paths. A new argument must be declared in the parser
# (set_defaults: `reads`, the paths the command reads; `writes`, its output folder) or listed here, or the
# classification test fails.
# `finetune` and `pretrain` take every TrainingArguments field as an option; none is a path but output_dir (their
# output folder, `writes`) and four they do not offer (training.CommandTrainingArguments says why).
TRAINER_PATHS = {"output_dir", "resume_from_checkpoint", "deepspeed", "fsdp_config", "accelerator_config"}
TRAINER_OPTIONS = {field.name for field in dataclasses.fields(transformers.TrainingArguments)} - TRAINER_PATHS
NOT_PATHS = {
    "convert": {"task", "no_verify", "force", "gelu", "lowercase"},
    "finetune": {"task", "max_length", "packing", "force", *TRAINER_OPTIONS},
    "pretrain": {
        "train_tokenizer",
        "mlm_probability",
        "whole_word_mask",
        "max_length",
        "num_proc",
        "resume",
        "force",
        *TRAINER_OPTIONS,
    },
    "export-bert": {"force"},
    "export-onnx": {"task", "opset", "quantize", "no_verify", "force"},
    "export-openvino": {"task", "quantize", "no_verify", "force", "precision"},
    "diagnose": {
        "layers",
        "placements",
        "steps",
        "hidden_size",
        "lr",
        "seed",
        "warmup",
        "quick",
        "force",
        "sweep",
        "lrs",
        "seeds",
        "heads",
        "batch_size",
        "init_std",
        "budget_minutes",
    },
}
WRITE_NO_FOLDER = {"card", "push"}  # card adds README.md to the folder it reads; push uploads and writes nothing

# A valid command line for each way of calling each folder-writing command, every path it reads given: {name} is an
# input of the `inputs` fixture, {out} the output. Together they must give every path argument the parser declares.
COMMAND_LINES = (
    "convert {bert} {out}",
    "export-bert {model} {out}",
    "export-onnx {model} {out}",
    "export-openvino {model} {out}",
    "finetune --model {model} --train {train.csv} --eval {eval.csv} --output {out}",
    "pretrain --model {model} --train {train.txt} --eval {eval.txt} --output {out} --max-length 32",
    "pretrain --config {config.json} --tokenizer {model} --train {train.txt} --output {out} --max-length 32",
    "diagnose --corpus {train.txt} --out {out}",
)
TEXT_INPUTS = {
    "train.csv": "text,label\ngood film,pos\nbad film,neg\n",
    "eval.csv": "text,label\nfine film,pos\ndull film,neg\n",
    "train.txt": "A first document.\n\nA second document.\n\nA third one.\n",
    "eval.txt": "An evaluation document.\n",
    "config.json": json.dumps({"hidden_size": 32, "num_hidden_layers": 1, "num_attention_heads": 4}),
}


def subcommands() -> dict:
    (commands,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices


def declared(command: str) -> tuple[set, str | None]:
    """The paths a command declares it reads and the folder it writes (their argument names)."""
    parser = subcommands()[command]
    return set(parser.get_default("reads") or ()), parser.get_default("writes")


def arguments(command: str) -> set:
    return {a.dest for a in subcommands()[command]._actions if not isinstance(a, argparse._HelpAction)}


def inputs_given(line: str) -> dict:
    """{placeholder: the argument it is given to} for the input paths of a command line, read by the real parser."""
    words = shlex.split(line)
    args = vars(build_parser().parse_args(words))
    return {args[name]: f"{words[0]} {name}" for name in sorted(declared(words[0])[0]) if args[name] is not None}


def test_every_argument_of_every_command_is_a_path_it_reads_its_output_or_declared_not_a_path():
    writing = set()
    for command in subcommands():
        reads, writes = declared(command)
        if command in WRITE_NO_FOLDER:
            assert writes is None, f"{command} writes a folder now: declare what it reads, add a COMMAND_LINES entry"
            continue
        assert writes in arguments(command), f"{command}: declare its output folder (set_defaults writes=...)"
        writing.add(command)
        assert reads <= arguments(command), f"{command}: declares arguments it does not have"
        unclassified = arguments(command) - reads - {writes} - NOT_PATHS[command]
        assert unclassified == set(), f"{command}: declare these in reads= if they are paths, else add to NOT_PATHS"
        assert reads & NOT_PATHS[command] == set()
    assert writing == set(NOT_PATHS)


def test_the_command_lines_below_give_every_path_argument_of_every_command():
    every = {f"{command} {name}" for command in NOT_PATHS for name in declared(command)[0]}
    assert {argument for line in COMMAND_LINES for argument in inputs_given(line).values()} == every


def located(inputs: Path, name: str) -> Path:
    """Where the input `name` lies: alone in a folder of its own, so that the folder holds no other input."""
    return inputs / f"holds-{name}" / name


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    """Tiny inputs of every kind: a BERT checkpoint, an EncoderStack folder that `--force` may replace (as a
    conversion leaves it), text, CSV, a config file. One level down in a folder of their own: the tests watch the
    folder above them (where a command would put what it writes beside its output) and it must hold nothing else."""
    root = tmp_path_factory.mktemp("inputs") / "inputs"
    root.mkdir()
    for name in ("bert", "model", *TEXT_INPUTS):
        located(root, name).parent.mkdir()
    bert_folder(located(root, "bert"))
    model = tiny_model_folder(located(root, "model"))
    (model / "conversion.json").write_text(json.dumps({"encoderstack_version": "0", "mapped": {}}))
    for name, text in TEXT_INPUTS.items():
        located(root, name).write_text(text)
    return root


def command_line(line: str, inputs: Path, output: Path) -> list[str]:
    words = [word.replace("{out}", str(output)) for word in shlex.split(line)]
    return [str(located(inputs, word.strip("{}"))) if word.startswith("{") else word for word in words]


def tree(root) -> dict:
    """Every file and folder under root, hidden ones included, with each file's content hash."""
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "folder"
        for path in sorted(root.rglob("*"))
    }


def refused_because_of(argv: list[str], sources: list[Path], capsys) -> None:
    """Exit 2, one line, and the line names one of `sources` as the input that the output would be or hold: the
    refusal is the input check, not merely "already exists" or "not ours", which a folder of ours would pass."""
    capsys.readouterr()
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert error.startswith("encoderstack: error: ") and error.count("\n") == 1, error
    assert any(re.search(rf"the source (folder |file )?{re.escape(str(source))}\b", error) for source in sources), error


WHERE = ("the output", "the output's parent", "the folder of every input")
CASES = [
    pytest.param(line, name, where, force, id=f"{argument} as {where}{' --force' if force else ''}")
    for line in COMMAND_LINES
    for name, argument in inputs_given(line).items()
    for where in WHERE
    for force in (False, True)
]


@pytest.mark.parametrize("line, name, where, force", CASES)
def test_an_output_that_is_or_holds_an_input_is_refused_before_any_work_and_touches_nothing(
    line, name, where, force, inputs, capsys
):
    source = located(inputs, name.strip("{}"))
    output = {WHERE[0]: source, WHERE[1]: source.parent, WHERE[2]: inputs}[where]
    named = [source] if where != WHERE[2] else [located(inputs, n.strip("{}")) for n in inputs_given(line)]
    before = tree(inputs.parent)
    refused_because_of(command_line(line, inputs, output) + ["--force"] * force, named, capsys)
    assert tree(inputs.parent) == before


@pytest.mark.parametrize("command", ["pretrain", "finetune"])
@pytest.mark.parametrize("argument", ["--model", "--train"])
def test_an_input_inside_the_hidden_checkpoint_folder_beside_the_output_is_refused(
    command, argument, inputs, tmp_path, capsys
):
    """Both commands delete `.OUT.checkpoints` when they finish or start over: it must not hold what they read."""
    checkpoints = tmp_path / ".out.checkpoints"
    suffix = ".txt" if command == "pretrain" else ".csv"
    given = {"--model": located(inputs, "model"), "--train": located(inputs, f"train{suffix}")}
    inside = checkpoints / ("checkpoint-2" if argument == "--model" else f"train{suffix}")
    checkpoints.mkdir()
    (shutil.copytree if argument == "--model" else shutil.copy)(given[argument], inside)
    given[argument] = inside
    argv = [command, *(str(word) for pair in given.items() for word in pair), "--max-length", "32"]
    argv += ["--eval", str(located(inputs, f"eval{suffix}")), "--output", str(tmp_path / "out"), "--force"]
    before = tree(tmp_path)
    refused_because_of(argv, [inside], capsys)
    assert tree(tmp_path) == before

"""The command line itself: Ctrl-C, numbers argparse would misread, the help of every option, `--version` and the
top-level help without torch."""

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_model_folder
from test_convert_bert import bert_folder

import encoderstack
import encoderstack_cli
from encoderstack.cli import build_parser, main
from encoderstack.conversion import converter

COMMANDS = (
    "convert",
    "finetune",
    "pretrain",
    "export-bert",
    "export-onnx",
    "export-openvino",
    "card",
    "push",
    "diagnose",
)
SRC = Path(encoderstack_cli.__file__).parent
SENTIMENT = "text,label\ngood film,pos\nbad film,neg\nfine film,pos\nawful film,neg\n"


def subcommands(parser):
    """(name, parser) of every subcommand, nested ones included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, subparser in action.choices.items():
                yield name, subparser
                yield from subcommands(subparser)


def options(parser):
    return [action for action in parser._actions if action.option_strings]


def interrupted_convert(tmp_path, monkeypatch):
    def interrupt(path, *args):  # after config.json: the partial folder is not empty
        raise KeyboardInterrupt

    monkeypatch.setattr(converter, "write_safetensors", interrupt)
    return ["convert", str(bert_folder(tmp_path / "bert")), str(tmp_path / "work" / "out")]


def interrupted_finetune(tmp_path, monkeypatch):
    def interrupt(history, path):  # inside the output folder, after the checkpoints were written
        raise KeyboardInterrupt

    monkeypatch.setattr("encoderstack.finetune.plot_losses", interrupt)
    (tmp_path / "train.csv").write_text(SENTIMENT)
    model, output = tiny_model_folder(tmp_path / "tiny"), tmp_path / "work" / "out"
    train = ["--train", str(tmp_path / "train.csv"), "--eval", str(tmp_path / "train.csv")]
    return ["finetune", "--model", str(model), *train, "--output", str(output), "--epochs", "1", "--batch-size", "4"]


@pytest.mark.parametrize("command", [interrupted_convert, interrupted_finetune], ids=["convert", "finetune"])
def test_ctrl_c_inside_a_command_prints_one_line_exits_130_and_leaves_no_partial_folder(
    command, tmp_path, monkeypatch, capsys
):
    argv = command(tmp_path, monkeypatch)
    (tmp_path / "work").mkdir()
    capsys.readouterr()
    assert main(argv) == 130
    error = capsys.readouterr().err  # after the progress bars of the run
    assert error.splitlines()[-1] == "encoderstack: interrupted" and "Traceback" not in error, error[-3000:]
    assert list((tmp_path / "work").iterdir()) == []  # neither the output, nor its partial or scratch folders


def exit_status(argv) -> int:
    """What `encoderstack ARGV` exits with: argparse's own refusals exit, the commands' checks return."""
    try:
        return main(argv)
    except SystemExit as exit:
        return exit.code


@pytest.mark.parametrize(
    "argv, message",
    [
        (["finetune", "--lr", "-1e-4"], "learning_rate must be a positive finite number, got -0.0001"),
        (
            ["pretrain", "--config", "hidden_size=32", "--train", "c.txt", "--mlm-probability", "-1.5E-1"],
            "mlm_probability must lie strictly between 0 and 1, got -0.15",
        ),
        (["diagnose", "--lr", "-3e-3"], "argument --lr: expected a positive finite number, got '-3e-3'"),
    ],
)
def test_a_negative_number_in_scientific_notation_gets_the_option_s_own_message(argv, message, capsys):
    assert exit_status(argv) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.endswith(f"error: {message}"), error


def test_convert_with_its_source_as_output_says_so_without_blaming_a_link(tmp_path, monkeypatch, capsys):
    source = bert_folder(tmp_path / "src")
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()  # what saving the source printed
    assert main(["convert", "src", "src", "--force"]) == 2
    assert capsys.readouterr().err == (
        f"encoderstack: error: {source}: the output folder is the source folder {source}\n"
    )
    (tmp_path / "link").symlink_to(source)
    assert main(["convert", "src", "link", "--force"]) == 2
    assert capsys.readouterr().err.endswith(f"is the source folder {source} (through a link)\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["link", "src"]


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out == f"encoderstack {encoderstack.__version__}\n"


def console_script(*argv) -> tuple[str, list[str]]:
    """`encoderstack ARGV` as the console script runs it, in a fresh Python: (its stdout, then what it had imported
    of torch, transformers and the encoderstack package)."""
    assert 'encoderstack = "encoderstack_cli:main"' in (SRC.parent / "pyproject.toml").read_text()
    probe = (
        "import sys, encoderstack_cli\n"
        "try:\n    encoderstack_cli.main()\nexcept SystemExit as exit:\n    assert exit.code == 0, exit.code\n"
        "print([name for name in ('torch', 'transformers', 'encoderstack') if name in sys.modules])"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(
        [sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, timeout=300, check=True
    )
    *output, imported = result.stdout.splitlines()
    return "\n".join(output), ast.literal_eval(imported)


@pytest.mark.parametrize("argv", [["--version"], ["--help"]])
def test_version_and_the_top_level_help_import_neither_torch_nor_transformers_nor_the_package(argv):
    output, imported = console_script(*argv)
    assert imported == []
    assert output == (f"encoderstack {encoderstack.__version__}" if argv == ["--version"] else top_level_help())


def top_level_help() -> str:
    return build_parser().format_help().rstrip("\n")


def test_a_command_s_own_help_comes_from_the_package_through_the_console_script():
    output, imported = console_script("finetune", "--help")
    assert imported == ["torch", "transformers", "encoderstack"]
    assert "--weight_decay" in output and output.startswith("usage: encoderstack finetune")


def test_every_option_of_every_command_has_a_help_text():
    commands = dict(subcommands(build_parser()))
    assert set(COMMANDS) <= set(commands)
    missing = [
        f"{name} {option.option_strings[0]}"
        for name, parser in commands.items()
        for option in options(parser)
        if not option.help
    ]
    assert missing == []


def test_every_option_with_a_default_shows_it_in_the_help(monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # one line per option, so that no default is wrapped
    for name, parser in subcommands(build_parser()):
        help_text = parser.format_help()
        for option in options(parser):
            if option.default in (None, argparse.SUPPRESS) or option.default is False or "default" in option.help:
                continue
            assert f"{option.help} (default: {option.default})" in help_text, (name, option.option_strings)

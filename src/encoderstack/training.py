"""What `finetune` and `pretrain` share: their errors; the checks of a model folder, its weights and its tokenizer;
the Trainer settings both start from (transformers' `TrainingArguments`, every field under its own name, with our
defaults and the old flag names as aliases); the settings record; the loss plot; and the run itself
(`train_and_save`): train, score the best checkpoint and the starting weights (without a second copy of the model on
the accelerator), write the output folder."""

import dataclasses
import json
import math
import os
import shutil
from contextlib import contextmanager
from pathlib import Path

import torch
import transformers

from .checkpoint import TOKENIZER_FILES, has_tokenizer
from .conversion.converter import open_source
from .conversion.keymap import FAMILIES, ConversionError
from .conversion.sources import has_hf_weights, require_hf_weights
from .hub_card import write_card
from .jsonfile import read_json_object
from .output_folder import OutputFolder


class TrainingError(ValueError):
    """A training run that cannot start: its settings, its model folder or its data (the message says which)."""


class DataError(TrainingError):
    """Training or evaluation data that cannot be used; the message names the file and the row."""


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# What Trainer (or torch's optimizers) would take only to fail late, or to train to NaN: each number's range.
NUMBER_RANGES = {
    "num_train_epochs": ("a positive finite number", lambda v: is_finite(v) and v > 0),
    "learning_rate": ("a positive finite number", lambda v: is_finite(v) and v > 0),
    "weight_decay": ("a finite number, 0 or more", lambda v: is_finite(v) and v >= 0),
    "adam_beta1": ("in [0, 1)", lambda v: is_finite(v) and 0 <= v < 1),
    "adam_beta2": ("in [0, 1)", lambda v: is_finite(v) and 0 <= v < 1),
    "adam_epsilon": ("a finite number, 0 or more", lambda v: is_finite(v) and v >= 0),
    "max_grad_norm": ("a finite number, 0 or more", lambda v: is_finite(v) and v >= 0),
    "warmup_steps": ("a finite number, 0 or more", lambda v: is_finite(v) and v >= 0),
    "label_smoothing_factor": ("in [0, 1)", lambda v: is_finite(v) and 0 <= v < 1),
    "neftune_noise_alpha": ("a positive finite number", lambda v: v is None or is_finite(v) and v > 0),
    "eval_delay": ("a finite number, 0 or more", lambda v: is_finite(v) and v >= 0),
    "logging_steps": ("a positive finite number", lambda v: is_finite(v) and v > 0),
    "eval_steps": ("a positive finite number", lambda v: v is None or is_finite(v) and v > 0),
    "save_steps": ("a positive finite number", lambda v: v is None or is_finite(v) and v > 0),
    "max_steps": ("a positive integer, or -1 (num_train_epochs decides)", lambda v: v == -1 or is_integer(v) and v > 0),
    "per_device_train_batch_size": ("a positive integer", lambda v: is_integer(v) and v > 0),
    "per_device_eval_batch_size": ("a positive integer", lambda v: is_integer(v) and v > 0),
    "gradient_accumulation_steps": ("a positive integer", lambda v: is_integer(v) and v > 0),
    "eval_accumulation_steps": ("a positive integer", lambda v: v is None or is_integer(v) and v > 0),
    "save_total_limit": ("a positive integer", lambda v: v is None or is_integer(v) and v > 0),
    "dataloader_num_workers": ("an integer, 0 or more", lambda v: is_integer(v) and v >= 0),
    "seed": ("an integer in [0, 2**32)", lambda v: is_integer(v) and 0 <= v < 2**32),
    "data_seed": ("an integer in [0, 2**32)", lambda v: v is None or is_integer(v) and 0 <= v < 2**32),
}
TRAINER_STATE = "trainer_state.json"  # Trainer writes it last into a checkpoint: a folder without it was cut short
# Optimizers whose own checks need the model (its target modules): Trainer makes them; only their package is ours.
NEEDS_THE_MODEL = ("galore", "apollo", "lomo", "adalomo")


def setting(default, help: str, *aliases: str):
    """A dataclass field that `HfArgumentParser` turns into `--name` (and `--na-me`) plus `aliases`."""
    return dataclasses.field(
        default=default, metadata={"help": help, **({"aliases": list(aliases)} if aliases else {})}
    )


@dataclasses.dataclass
class CommandTrainingArguments(transformers.TrainingArguments):
    """`TrainingArguments` as `finetune` and `pretrain` start from them: our defaults where they differ from
    transformers', the flags the commands had before as aliases, and numbers that would train nothing (or NaN)
    refused. The output folder is the command's: its checkpoints go to a hidden folder beside it."""

    learning_rate: float = setting(1e-4, "peak learning rate", "--lr")
    weight_decay: float = setting(0.01, "AdamW weight decay")
    save_total_limit: int | None = setting(1, "checkpoints kept (the best one always is)")
    use_cpu: bool | None = setting(None, "train on the CPU (default: when no CUDA device is present)")
    # Not offered: paths the commands' input checks do not cover (--resume continues a run; the configs of deepspeed,
    # FSDP and accelerate come from `accelerate launch` instead).
    resume_from_checkpoint: str | None = dataclasses.field(default=None, init=False)
    deepspeed: dict | str | None = dataclasses.field(default=None, init=False)
    fsdp_config: dict | str | None = dataclasses.field(default=None, init=False)
    accelerator_config: dict | str | None = dataclasses.field(default=None, init=False)

    def __post_init__(self):
        """Every value checked here, when the settings are made, before any data or model: transformers' own checks
        (its `__post_init__`), and what it leaves to Trainer, which fails late or trains to NaN on it: numbers out
        of range (`NUMBER_RANGES`), a tracker in `report_to` that is not installed, an optimizer whose package is
        missing. What the run produces is `check_run`'s."""
        if self.use_cpu is None:
            self.use_cpu = not torch.cuda.is_available()
        for name, (expected, allowed) in NUMBER_RANGES.items():
            if not allowed(getattr(self, name)):
                raise TrainingError(f"{name} must be {expected}, got {getattr(self, name)!r}")
        try:
            super().__post_init__()
        except ValueError as error:  # an optimizer name, a precision this machine lacks, ...
            raise TrainingError(f"training settings: {' '.join(str(error).split())}") from None
        self.check_trackers()
        self.check_optimizer()

    def check_trackers(self) -> None:
        from transformers.integrations import INTEGRATION_TO_CALLBACK, get_available_reporting_integrations

        installed = get_available_reporting_integrations()
        for name in self.report_to:
            if name not in INTEGRATION_TO_CALLBACK:
                known = ", ".join(sorted(INTEGRATION_TO_CALLBACK))
                raise TrainingError(f"report_to: {name!r} is not a tracker transformers reports to ({known})")
            if name not in installed:
                raise TrainingError(f"report_to: {name} is not installed (installed: {', '.join(installed) or 'none'})")

    def check_optimizer(self) -> None:
        optim = transformers.training_args.OptimizerNames(self.optim).value
        try:
            transformers.Trainer.get_optimizer_cls_and_kwargs(self)
        except ImportError as error:
            raise TrainingError(f"optim {optim}: {' '.join(str(error).split())}") from None
        except ValueError as error:  # torch_xla's, torchdistx's, grokadamw's missing package; GaLore's missing model
            if not optim.startswith(NEEDS_THE_MODEL):
                raise TrainingError(f"optim {optim}: {' '.join(str(error).split())}") from None

    def check_run(self, command: str, metrics: tuple, labels: tuple, **values) -> None:
        """What `command`'s run produces: `metrics` (its evaluation's, `loss` besides) for `metric_for_best_model`,
        `labels` (its batches' label columns) for `label_names`; and the fields `command` sets itself (`values`: its
        best checkpoint, its own resume, ...), any other value of which is refused."""
        for name, value in values.items():
            if getattr(self, name) != value:
                raise TrainingError(f"{name}={getattr(self, name)!r}: {command} needs {value!r} here")
        metric = self.metric_for_best_model
        if metric is not None and metric.removeprefix("eval_") not in ("loss", *metrics):
            raise TrainingError(
                f"metric_for_best_model {metric!r}: {command} evaluates {', '.join(('loss', *metrics))} "
                "(with or without eval_)"
            )
        for name in self.label_names or ():
            if name not in labels:
                raise TrainingError(
                    f"label_names: {command}'s batches have no {name!r} (their labels: {', '.join(labels)})"
                )


def settings_from(values: dict, *types) -> list[dict]:
    """`values` (keywords named as the fields of the dataclasses `types`, or as their aliases) as one keyword dict per
    dataclass; an unknown name, and two names for one field, are refused."""
    names = {}
    for kind in types:
        for field in (field for field in dataclasses.fields(kind) if field.init):
            for alias in (field.name, *field.metadata.get("aliases", ())):
                names[alias.lstrip("-").replace("-", "_")] = (kind, field.name)
    split, given = {kind: {} for kind in types}, {}
    for key, value in values.items():
        if key not in names:
            raise TrainingError(f"unknown setting {key!r}")
        kind, name = names[key]
        if (first := given.setdefault(name, key)) != key:
            raise TrainingError(f"{first} and {key} both set {name}; give one")
        split[kind][name] = value
    return [split[kind] for kind in types]


UNRECORDED = {"output_dir", "local_rank", "hub_token", "use_cpu"}  # where, which process, a secret, which machine


def settings_record(settings, training: transformers.TrainingArguments) -> dict:
    """The run's settings, by content (as JSON gives them back): the command's own (its paths and switches aside)
    and every `TrainingArguments` field but where the run writes, which process it is, a token and the machine's."""
    record = {k: v for k, v in dataclasses.asdict(settings).items() if k not in settings.RUN_ONLY}
    record |= {k: v for k, v in training.to_dict().items() if k not in UNRECORDED}
    return json.loads(json.dumps(record, default=str))


@contextmanager
def datasets_offline(progress: bool = True):
    """`datasets`, loading only what is local, quiet about the errors it re-raises (ours name the file), and without
    progress bars unless `progress`."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # everything here is local; never let datasets look online
    import datasets

    verbosity, bars = datasets.logging.get_verbosity(), datasets.is_progress_bar_enabled()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)
    if not progress:
        datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.logging.set_verbosity(verbosity)
        if bars:
            datasets.enable_progress_bars()


def model_config(model) -> dict:
    """The config.json of an EncoderStack or BERT folder that has a tokenizer: checked before anything is loaded."""
    folder = Path(model)
    if not folder.is_dir():
        raise TrainingError(f"{folder}: no such model folder")
    config = read_json_object(folder / "config.json", TrainingError)
    if config.get("model_type") != "encoderstack" and config.get("model_type") not in FAMILIES:
        raise TrainingError(
            f"{folder / 'config.json'}: model_type {config.get('model_type')!r} is not an EncoderStack or BERT model"
        )
    if not has_tokenizer(folder):
        raise TrainingError(
            f"{folder}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); training takes the tokenizer from the model"
        )
    return config


def source_family(model) -> str | None:
    """The family a model folder came from, for the card of what trains on it: its own `model_type` (a BERT-family
    folder converts as it loads), else the `source_family` that the record of the command that wrote it holds."""
    folder = Path(model)
    model_type = read_json_object(folder / "config.json", TrainingError).get("model_type")
    if model_type in FAMILIES:
        return model_type
    for name in ("conversion.json", "finetune.json", "pretrain.json"):
        try:
            family = read_json_object(folder / name, TrainingError).get("source_family")
        except TrainingError:  # no such record, or not one we can read: the card just names no family
            continue
        if family in FAMILIES:
            return family
    return None


def check_weights(model, error: type[Exception] = TrainingError) -> None:
    """A model folder whose weights are missing or do not read fails here, before any data is read (transformers
    would fail after loading it), with convert's own message as the command's error."""
    folder = Path(model)
    try:
        if has_hf_weights(folder):
            require_hf_weights(folder).close()
        else:  # a BERT folder may hold a TensorFlow checkpoint instead: from_pretrained converts it
            open_source(folder).tensors.close()
    except ConversionError as error_in_weights:
        raise error(str(error_in_weights)) from None


def load_tokenizer(model, config):
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as error:
        raise TrainingError(f"{model}: the tokenizer does not load ({' '.join(str(error).split())})") from None
    if len(tokenizer) > config.get("vocab_size", len(tokenizer)):
        raise TrainingError(
            f"{model}: the tokenizer has {len(tokenizer)} tokens but the model only "
            f"{config['vocab_size']} embeddings (vocab_size in config.json)"
        )
    return tokenizer


def require_matplotlib(extra: str) -> None:
    try:
        import matplotlib  # noqa: F401  (fail before training, not after it)
    except ImportError:
        raise TrainingError(f"the loss plot needs matplotlib: pip install 'encoderstack[{extra}]'") from None


def flattening_collator() -> transformers.DataCollatorWithFlattening:
    """Each batch as one flattened row described by `cu_seq_lens_q/k` only: the model numbers each sequence's
    positions itself, from the family's offset (the collator's own `position_ids` start at 0, below RoBERTa's)."""
    return transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_position_ids=False)


def output_beside_checkpoints(args: transformers.TrainingArguments, force: bool, inputs) -> OutputFolder:
    """The command's output folder, checked before any work (no input may lie where the run writes, replaces or
    deletes); Trainer's checkpoints go to a hidden folder beside it until the run is over."""
    destination = OutputFolder(args.output_dir, force, inputs=inputs, siblings=["checkpoints"])
    args.output_dir = str(destination.sibling("checkpoints"))
    return destination


def checkpoints(scratch: Path) -> list[Path]:
    """The run's checkpoint-N folders, oldest first."""
    found = [p for p in scratch.glob("checkpoint-*") if p.is_dir() and p.name.split("-")[1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[1]))


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / TRAINER_STATE).is_file()


def train_and_save(
    trainer: transformers.Trainer,
    tokenizer,
    destination: OutputFolder,
    record_file: str,
    record: dict,
    results,
    plot,
    evaluate_best: bool = True,
    resume_from_checkpoint: str | None = None,
    resumable: bool = False,
) -> dict:
    """The run `finetune` and `pretrain` share, given the task's Trainer: train; the best checkpoint's evaluation
    (`after`: evaluated again with `evaluate_best`, else the one logged during training); the starting weights'
    (`before`); `record` completed by `results(trainer, train_output, history, before, after, best_step)`; and on the
    main process the output folder: the best model, the tokenizer, `record_file`, `loss.png` (drawn by
    `plot(history, before, path)`) and the card. Trainer's checkpoints are removed at the end, and on an error
    unless the run is `resumable` and one of them is complete."""
    scratch, metric = Path(trainer.args.output_dir), "eval_" + trainer.args.metric_for_best_model.removeprefix("eval_")
    # The starting point is scored after training, from a copy on the CPU: under DDP (transformers 5.24) a
    # Trainer.evaluate() before train() changes what the processes then train (measured: 3e-2 off the one-process
    # weights), and a copy on the accelerator would double the model's memory there for the whole run.
    starting_weights = cpu_weights(trainer.model)
    try:
        output = trainer.train(resume_from_checkpoint=resume_from_checkpoint)
        history = list(trainer.state.log_history)
        best_step = int(Path(trainer.state.best_model_checkpoint).name.split("-")[-1])
        if evaluate_best:
            after = trainer.evaluate()  # the best checkpoint, reloaded by load_best_model_at_end
        else:
            after = next(entry for entry in history if metric in entry and entry["step"] == best_step)
        before = evaluate_weights(trainer, starting_weights)
        del starting_weights
        record = {**record, **results(trainer, output, history, before, after, best_step)}
        if trainer.is_world_process_zero():
            with destination as folder:
                trainer.save_model(folder)
                tokenizer.save_pretrained(folder)
                (folder / record_file).write_text(json.dumps(record, indent=2) + "\n")
                plot(history, before, folder / "loss.png")
                write_card(folder, repo_id=destination.path.name)
    except BaseException:  # an interrupted resumable run keeps its checkpoints for --resume, if one is complete
        if trainer.args.should_save and not (resumable and any(map(is_complete, checkpoints(scratch)))):
            shutil.rmtree(scratch, ignore_errors=True)
        raise
    if trainer.args.should_save:
        shutil.rmtree(scratch, ignore_errors=True)
    return record


def cpu_weights(model) -> dict:
    return {name: tensor.detach().to("cpu", copy=True) for name, tensor in model.state_dict().items()}


def evaluate_weights(trainer: transformers.Trainer, weights: dict) -> dict:
    """`trainer.evaluate()` of `weights` (a state dict on the CPU) loaded into the trainer's own model in place, its
    weights put back after: the starting point is scored without a second copy of the model on the accelerator."""
    current = cpu_weights(trainer.model)
    trainer.model.load_state_dict(weights)
    try:
        return trainer.evaluate()
    finally:
        trainer.model.load_state_dict(current)


def plot_losses(
    log_history: list[dict],
    path: Path,
    title: str = "Fine-tuning loss",
    eval_key: str = "eval_loss",
    learning_rate: bool = False,
) -> None:
    """Training and evaluation loss against steps, and with `learning_rate` the schedule on a second axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=100)
    for key, label in (("loss", "training"), (eval_key, "evaluation")):
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry]
        if points:
            axes.plot(*zip(*points), marker="o" if key == eval_key else None, label=label)
    axes.set(xlabel="step", ylabel="loss", title=title)
    axes.legend(loc="upper right")
    rates = [(entry["step"], entry["learning_rate"]) for entry in log_history if "learning_rate" in entry]
    if learning_rate and rates:
        schedule = axes.twinx()
        schedule.plot(*zip(*rates), color="grey", linestyle=":", label="learning rate")
        schedule.set_ylabel("learning rate")
        schedule.legend(loc="center right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)

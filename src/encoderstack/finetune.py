"""`encoderstack finetune`: fine-tune an EncoderStack (or BERT) checkpoint with transformers' Trainer.

Data is CSV or JSON lines, read with `datasets` and checked row by row before any training starts. Runs the same under
`torchrun` and `accelerate launch` (Trainer does the data parallelism); only the main process writes the results.
"""

import csv
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

import numpy as np
import torch
import transformers

from . import modeling_encoderstack
from .conversion import keymap
from .conversion.keymap import ConversionError, task_for_architecture
from .data import SENTIMENT as DATA  # finetune.DATA: the name callers import
from .output_folder import terminating_signals_raise
from .training import (
    CommandTrainingArguments,
    DataError,
    TrainingError,
    check_weights,
    datasets_offline,
    flattening_collator,
    is_integer,
    load_tokenizer,
    model_config,
    output_beside_checkpoints,
    plot_losses,
    require_matplotlib,
    setting,
    settings_from,
    settings_record,
    source_family,
    train_and_save,
)

# Heads whose `classifier` weights another of them would load as its own when the shapes agree.
CLASSIFIER_HEADS = (
    "EncoderStackForSequenceClassification",
    "EncoderStackForTokenClassification",
    "EncoderStackForQuestionAnswering",
    "EncoderStackForMultipleChoice",
)
FinetuneError = TrainingError  # the name finetune's callers catch


@dataclass
class FinetuneArguments:
    """What `finetune` itself takes (Trainer's settings are `FinetuneTrainingArguments`)."""

    RUN_ONLY: ClassVar = ("model", "train", "eval", "force")  # recorded by content elsewhere, or not a setting

    model: str | None = setting(
        None,
        "EncoderStack or BERT folder (the command's default: ./encoderstack-all-MiniLM-L6-v2, else the embedded one)",
    )
    task: Literal["text-classification", "token-classification", "question-answering"] = setting(
        "text-classification", "the head to train"
    )
    train: str | None = setting(None, "CSV or JSON lines (default: the shipped sentiment data)")
    eval: str | None = setting(None, "CSV or JSON lines (default: the shipped sentiment data)")
    max_length: int = setting(128, "tokens per example; longer ones are cut")
    packing: bool = setting(False, "token classification: each batch as one flattened row (DataCollatorWithFlattening)")
    force: bool = setting(False, "replace an existing output folder")

    def __post_init__(self):
        if not (is_integer(self.max_length) and self.max_length > 0):
            raise TrainingError(f"max_length must be a positive integer, got {self.max_length!r}")
        if self.task not in TASKS:
            raise TrainingError(f"unknown task {self.task!r}; choose from {', '.join(TASKS)}")
        if self.packing and self.task != "token-classification":
            raise TrainingError(
                f"packing flattens each batch into one row with token labels only; {self.task} needs "
                "per-sequence labels or span positions the flattening collator does not carry"
            )
        self.train = self.train or str(DATA / "train.csv")
        if self.eval is None:  # scoring a model of your data on the shipped reviews would look plausible
            if Path(self.train) != DATA / "train.csv":
                raise TrainingError(f"{self.train}: no evaluation data given for it (eval, --eval)")
            self.eval = str(DATA / "dev.csv")


@dataclass
class FinetuneTrainingArguments(CommandTrainingArguments):
    """Trainer's settings for fine-tuning: an evaluation and a checkpoint each epoch, the best one kept."""

    output_dir: str | None = setting("encoderstack-finetuned", "where the best checkpoint goes", "--output")
    num_train_epochs: float = setting(3.0, "passes over the training data", "--epochs")
    per_device_train_batch_size: int = setting(16, "examples per process and step", "--batch-size")
    per_device_eval_batch_size: int = setting(16, "examples per process in evaluation")
    optim: str = setting("adamw_torch", "any TrainingArguments optim, e.g. sgd")
    warmup_steps: float = setting(0.1, "linear warm-up: optimizer steps, or below 1 a share of the run")
    eval_strategy: str = setting("epoch", "when to evaluate (and keep the best checkpoint)")
    save_strategy: str = setting("epoch", "when to save a checkpoint (as eval_strategy)")
    logging_steps: float = setting(0.05, "steps between loss logs, or below 1 a share of the run")
    load_best_model_at_end: bool = setting(True, "keep the best checkpoint (finetune needs it)")
    train_sampling_strategy: str = setting("sequential", "the data is shuffled once, by seed, before training")


def read_text(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise DataError(f"{path}: cannot read ({error.strerror})") from None
    try:
        return data.decode("utf-8-sig")  # a spreadsheet's byte-order mark is not part of the first column's name
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(f"{path}: line {line}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def read_rows(path, cache):
    """Rows of a CSV file (with a header) or a JSON-lines file as a `datasets.Dataset` (read by its `csv` or `json`
    loader, cached under `cache`, kept in memory), each with its row number in `_row`: a CSV's as a spreadsheet shows
    it (the header is row 1, whatever line breaks quoted cells hold), a JSON-lines file's line."""
    path = Path(path)
    text = read_text(path)
    if not text.strip():
        raise DataError(f"{path}: no rows")
    json_lines = path.suffix in (".jsonl", ".json")
    with datasets_offline(progress=False) as datasets:
        options = {}
        if not json_lines:  # every cell a string, an empty one "" (pandas would guess numbers, dates and NaN)
            stream = io.StringIO(text)
            header = next(csv.reader(stream), [])
            if not stream.read().strip():  # what follows the header: datasets would say "corresponds to no data"
                raise DataError(f"{path}: a header and no rows")
            strings = datasets.Features(dict.fromkeys(header, datasets.Value("string")))
            options = {"keep_default_na": False, "features": strings}
        try:
            rows = datasets.load_dataset(
                "json" if json_lines else "csv",
                data_files=str(path),
                split="train",
                cache_dir=str(cache),
                keep_in_memory=True,
                **options,
            )
        except datasets.exceptions.DatasetGenerationError as error:
            raise DataError(f"{path}: {unreadable(text, json_lines, error.__cause__)}") from None
    if json_lines:
        numbers = [number for number, line in enumerate(text.split("\n"), 1) if line.strip()]
    else:
        numbers = range(2, len(rows) + 2)
    if len(numbers) != len(rows):  # a JSON array on a line gives a row per element
        raise DataError(f"{path}: {unreadable(text, json_lines, None)}")
    return rows.add_column("_row", list(numbers))


def unreadable(text: str, json_lines: bool, cause) -> str:
    """Why `datasets` could not read a file: pandas' reason for a CSV, the first line that is not a JSON object."""
    if not json_lines:
        return f"not valid CSV ({' '.join(str(cause).split())})"
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines(): a string may hold U+2028, \f, ...
        try:
            row = json.loads(line) if line.strip() else {}
        except ValueError as error:
            return f"row {number}: not a JSON object ({error})"
        if not isinstance(row, dict):
            return f"row {number}: not a JSON object"
    return f"not JSON lines ({cause})"


def is_text(value) -> bool:
    return isinstance(value, str)


def is_label(value) -> bool:
    return isinstance(value, str) or is_integer(value)


def is_words(value) -> bool:  # a CSV field is a string, split at spaces
    return isinstance(value, str) or isinstance(value, list) and all(isinstance(word, str) for word in value)


def is_offset(value) -> bool:
    return is_integer(value) and value >= 0 or isinstance(value, str) and value.isascii() and value.isdigit()


TEXT, WORDS = (is_text, "a string"), (is_words, "a list of strings")
COLUMN_TYPES = {
    "text": TEXT,
    "text_pair": TEXT,
    "question": TEXT,
    "context": TEXT,
    "answer": TEXT,
    "label": (is_label, "a string or an integer"),
    "tokens": WORDS,
    "tags": WORDS,
    "answer_start": (is_offset, "a character offset (an integer, 0 or more)"),
}


def require(rows, path, columns, optional=()) -> None:
    for row in rows:
        for column in (*columns, *optional):
            value = row.get(column)
            if value in (None, "", []):
                if column in optional:
                    continue
                raise DataError(f"{path}: row {row['_row']}: missing column {column!r}")
            allowed, kind = COLUMN_TYPES[column]
            if not allowed(value):
                raise DataError(f"{path}: row {row['_row']}: column {column!r} must be {kind}, got {value!r}")


def as_list(value) -> list:
    return value if isinstance(value, list) else str(value).split()


@dataclass
class Task:
    """How one kind of task reads its rows, encodes them and scores predictions."""

    name: str  # one of conversion's tasks, whose head it trains
    columns: tuple
    metric: str
    optional: tuple = ()

    @property
    def model_class(self) -> str:
        return keymap.TASKS[self.name].encoderstack_class

    def labels(self, rows) -> list[str]:
        if self.name == "text-classification":
            return sorted({str(row["label"]) for row in rows})
        if self.name == "token-classification":
            return sorted({str(tag) for row in rows for tag in as_list(row["tags"])})
        return []

    def encode(self, rows, path, tokenizer, label2id, max_length, positions=None):
        """Every row's features (`Dataset.map`, with a progress bar); `positions` (the model's learned position
        embeddings) caps their length."""
        encode_row = getattr(self, "_encode_" + self.name.replace("-", "_"))

        def features(row):
            encoded = encode_row(row, path, tokenizer, label2id, max_length)
            if positions is not None and len(encoded["input_ids"]) > positions:
                raise DataError(
                    f"{path}: row {row['_row']}: {len(encoded['input_ids'])} tokens, more than the "
                    f"model's {positions} positions (max_position_embeddings); use a max_length of at "
                    f"most {positions}"
                )
            return encoded

        return rows.map(features, remove_columns=rows.column_names, desc=f"Tokenizing {Path(path).name}")

    def _label_id(self, label, row, path, label2id):
        if str(label) not in label2id:
            raise DataError(
                f"{path}: row {row['_row']}: unknown label {label!r} (training labels: {', '.join(label2id)})"
            )
        return label2id[str(label)]

    def _encode_text_classification(self, row, path, tokenizer, label2id, max_length):
        pair = row.get("text_pair") or None
        features = tokenizer(row["text"], pair, truncation=True, max_length=max_length)
        return {**features, "labels": self._label_id(row["label"], row, path, label2id)}

    def _encode_token_classification(self, row, path, tokenizer, label2id, max_length):
        tokens, tags = as_list(row["tokens"]), as_list(row["tags"])
        if len(tokens) != len(tags):
            raise DataError(f"{path}: row {row['_row']}: {len(tokens)} tokens but {len(tags)} tags")
        features = tokenizer(tokens, is_split_into_words=True, truncation=True, max_length=max_length)
        previous, labels = None, []
        for word in features.word_ids():  # label the first piece of each word; -100 elsewhere
            labels.append(-100 if word is None or word == previous else self._label_id(tags[word], row, path, label2id))
            previous = word
        return {**features, "labels": labels}

    def _encode_question_answering(self, row, path, tokenizer, label2id, max_length):
        context, answer = str(row["context"]), str(row["answer"])
        start = int(row["answer_start"]) if row.get("answer_start") not in (None, "") else context.find(answer)
        if start < 0 or context[start : start + len(answer)] != answer:
            raise DataError(f"{path}: row {row['_row']}: the answer {answer!r} is not in the context")
        features = tokenizer(
            str(row["question"]), context, truncation="only_second", max_length=max_length, return_offsets_mapping=True
        )
        offsets, sequence = features.pop("offset_mapping"), features.sequence_ids()
        in_context = [i for i, s in enumerate(sequence) if s == 1]
        end = start + len(answer)
        first = [i for i in in_context if offsets[i][0] <= start < offsets[i][1]]
        last = [i for i in in_context if offsets[i][0] < end <= offsets[i][1]]
        if not first or not last:
            raise DataError(f"{path}: row {row['_row']}: the answer lies beyond max_length={max_length} tokens")
        return {**features, "start_positions": first[0], "end_positions": last[0]}

    @property
    def metric_names(self) -> tuple:
        """What `metrics` returns."""
        return ("exact_match",) if self.name == "question-answering" else ("accuracy", "f1")

    def metrics(self, prediction: transformers.EvalPrediction) -> dict:
        if self.name == "question-answering":
            start_logits, end_logits = prediction.predictions[:2]
            starts, ends = prediction.label_ids
            hit = (start_logits.argmax(-1) == starts) & (end_logits.argmax(-1) == ends)
            return {"exact_match": float(hit.mean())}
        predicted, gold = prediction.predictions.argmax(-1), prediction.label_ids
        keep = gold != -100
        predicted, gold = predicted[keep], gold[keep]
        f1s = []
        for label in np.unique(gold):
            tp = np.sum((predicted == label) & (gold == label))
            precision, recall = tp / max(np.sum(predicted == label), 1), tp / max(np.sum(gold == label), 1)
            f1s.append(0.0 if tp == 0 else 2 * precision * recall / (precision + recall))
        return {"accuracy": float(np.mean(predicted == gold)), "f1": float(np.mean(f1s))}


TASKS = {
    "text-classification": Task("text-classification", ("text", "label"), "accuracy", optional=("text_pair",)),
    "token-classification": Task("token-classification", ("tokens", "tags"), "f1"),
    "question-answering": Task(
        "question-answering", ("question", "context", "answer"), "exact_match", optional=("answer_start",)
    ),
}


def collator(task: Task, tokenizer, packing: bool = False):
    """Padding to each batch's longest row, or with `packing`, the batch as one flattened row (no padding at all):
    transformers' `DataCollatorWithFlattening`, for token-level tasks (it carries token labels only)."""
    if packing:
        return flattening_collator()
    if task.name == "token-classification":
        return transformers.DataCollatorForTokenClassification(tokenizer)
    return transformers.DataCollatorWithPadding(tokenizer)


def best_evaluation(log_history: list[dict], metric: str) -> dict | None:
    """The evaluation whose checkpoint to keep: the best `metric`; of those tied, the lowest eval loss (then the
    earliest)."""
    evaluations = [entry for entry in log_history if f"eval_{metric}" in entry]
    return max(evaluations, key=lambda e: (e[f"eval_{metric}"], -e["eval_loss"], -e["step"]), default=None)


class TiesToTheLowerLoss(transformers.TrainerCallback):
    """Trainer takes an evaluation as the new best only when its metric is strictly better, so of tied evaluations
    it keeps the first (accuracy 1.0 at eval loss 0.288 kept over a later 1.0 at 0.012). Runs after each evaluation
    is logged and before Trainer compares it: when this one is the best by `best_evaluation`, Trainer takes it."""

    def __init__(self, metric: str):
        self.metric = metric

    def on_evaluate(self, args, state, control, **kwargs):
        best = best_evaluation(state.log_history, self.metric)
        if best is not None and best["step"] == state.global_step:
            state.best_metric = None  # no best so far: any metric beats it


def scores(evaluation: dict) -> dict:
    timings = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")
    return {
        k.removeprefix("eval_"): v
        for k, v in evaluation.items()
        if k.startswith("eval_") and k.removeprefix("eval_") not in timings
    }


def head_class(config, path: Path) -> str | None:
    """The EncoderStack class the weights of the folder (`path`: its config.json) are for (a BERT architecture is
    translated), None if unknown."""
    architecture = (config.get("architectures") or [None])[0]
    if config["model_type"] == "encoderstack" or architecture is None:
        return architecture
    try:
        return task_for_architecture(architecture)[1].encoderstack_class
    except ConversionError as error:  # the model folder is fine-tuning's input: its error, not a conversion's
        raise FinetuneError(f"{path}: {error}") from None


def training_labels(config, model, spec: Task, labels: list[str]) -> list[str]:
    """The labels to train, in the order of the folder's own head when it is this task's. A head of another task is
    refused: its `classifier` weights would become the new head's whenever the shapes agree."""
    head = head_class(config, Path(model) / "config.json")
    if head in CLASSIFIER_HEADS and head != spec.model_class:
        raise FinetuneError(
            f"{Path(model) / 'config.json'}: the folder holds an {head} head; fine-tuning it for "
            f"{spec.name} would start from that head's weights (start from a base or masked-LM model)"
        )
    if head != spec.model_class or not labels:
        return labels
    id2label = config.get("id2label") or {i: f"LABEL_{i}" for i in range(config.get("num_labels", 2))}
    trained = [str(id2label[key]) for key in sorted(id2label, key=int)]
    if sorted(trained) != labels:
        raise FinetuneError(
            f"{Path(model) / 'config.json'}: its {head} head was trained for the labels "
            f"{', '.join(trained)}; the training data has {', '.join(labels)}"
        )
    return trained


def finetune(model=None, output=None, **settings) -> dict:
    """Fine-tune `model` (an EncoderStack or BERT folder) on `train`, keep the best checkpoint by `eval`, and write it
    to `output` with its tokenizer, `finetune.json` (data, settings, metrics) and `loss.png`. `settings`: the fields of
    `FinetuneArguments` and of `FinetuneTrainingArguments` (every `TrainingArguments` field, e.g. `bf16=True`), or
    their aliases (`epochs`, `batch_size`, `lr`). `eval` defaults to the shipped held-out set only when `train` is
    the shipped training set.

    Settings, model folder and data are all checked before any model is loaded (FinetuneError, DataError)."""
    ours, trainer_settings = settings_from(
        {"model": model, **({"output": output} if output is not None else {}), **settings},
        FinetuneArguments,
        FinetuneTrainingArguments,
    )
    run = FinetuneArguments(**ours)
    spec = TASKS[run.task]
    args = FinetuneTrainingArguments(**{"metric_for_best_model": spec.metric, **trainer_settings})
    labels = ("start_positions", "end_positions") if run.task == "question-answering" else ("labels",)
    args.check_run("finetune", spec.metric_names, labels, load_best_model_at_end=True)
    require_matplotlib("plots")
    destination = output_beside_checkpoints(args, run.force, inputs=[run.model, run.train, run.eval])
    config = model_config(run.model)
    with destination.scratch("data") as cache:
        train_rows, eval_rows = read_rows(run.train, cache), read_rows(run.eval, cache)
    require(train_rows, run.train, spec.columns, spec.optional)
    require(eval_rows, run.eval, spec.columns, spec.optional)
    labels = spec.labels(train_rows)
    if spec.name != "question-answering" and len(labels) < 2:  # one label: Trainer would fit a regression
        raise DataError(f"{run.train}: every row has the label {labels[0]!r}; a classifier needs at least two")
    labels = training_labels(config, run.model, spec, labels)
    check_weights(run.model)
    label2id = {label: i for i, label in enumerate(labels)}
    tokenizer = load_tokenizer(run.model, config)
    absolute = config.get("position_embedding_type", "absolute") == "absolute"
    positions = config.get("max_position_embeddings") if absolute else None
    train_set = spec.encode(train_rows, run.train, tokenizer, label2id, run.max_length, positions)
    # Shuffled once here and then read in order, so that the batches do not depend on the number of processes:
    # N processes with batch b reproduce one process with batch N*b (Trainer's samplers differ between the two).
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(args.seed)).tolist()
    train_set = train_set.select(order)
    eval_set = spec.encode(eval_rows, run.eval, tokenizer, label2id, run.max_length, positions)
    transformers.set_seed(args.seed)
    label_config = (
        {"num_labels": len(labels), "id2label": dict(enumerate(labels)), "label2id": label2id} if labels else {}
    )
    record = {
        "task": run.task,
        "base_model": str(run.model),
        "source_family": source_family(run.model),
        "train": str(run.train),
        "eval": str(run.eval),
        "train_rows": len(train_set),
        "eval_rows": len(eval_set),
        "labels": labels,
        "settings": {**settings_record(run, args), "world_size": args.world_size},
    }
    with terminating_signals_raise():  # SIGTERM, too, ends in train_and_save's cleanup of the checkpoints
        network = getattr(modeling_encoderstack, spec.model_class).from_pretrained(run.model, **label_config)
        trainer = transformers.Trainer(
            model=network,
            args=args,
            train_dataset=train_set,
            eval_dataset=eval_set,
            data_collator=collator(spec, tokenizer, run.packing),
            compute_metrics=spec.metrics,
            callbacks=[TiesToTheLowerLoss(args.metric_for_best_model)],
        )
        return train_and_save(trainer, tokenizer, destination, "finetune.json", record, results, plot)


def results(trainer, output, history, before, after, best_step) -> dict:
    return {"before": scores(before), "after": scores(after), "best_checkpoint_step": best_step}


def plot(history, before, path) -> None:
    plot_losses(history, path)

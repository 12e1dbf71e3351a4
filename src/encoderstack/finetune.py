"""`encoderstack finetune`: fine-tune an EncoderStack (or BERT) checkpoint with transformers' Trainer.

Data is CSV or JSON lines, checked row by row before any training starts. Runs the same under `torchrun` and
`accelerate launch` (Trainer does the data parallelism); only the main process writes the results.
"""

import copy
import csv
import io
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

from . import modeling_encoderstack
from .checkpoint import TOKENIZER_FILES, has_tokenizer
from .conversion.converter import open_source
from .conversion.keymap import FAMILIES, ConversionError, task_for_architecture
from .conversion.sources import has_hf_weights, require_hf_weights
from .hub_card import write_card
from .jsonfile import read_json_object
from .output_folder import OutputFolder, terminating_signals_raise

DATA = Path(__file__).parent / "data" / "sentiment"
# Heads whose `classifier` weights another of them would load as its own when the shapes agree.
CLASSIFIER_HEADS = (
    "EncoderStackForSequenceClassification",
    "EncoderStackForTokenClassification",
    "EncoderStackForQuestionAnswering",
    "EncoderStackForMultipleChoice",
)


class FinetuneError(ValueError):
    """A fine-tuning run that cannot start: its settings, its model folder or its data (the message says which)."""


class DataError(FinetuneError):
    """Training or evaluation data that cannot be used; the message names the file and the row."""


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


def read_rows(path) -> list[dict]:
    """Rows of a CSV file (with a header) or a JSON-lines file, each with its 1-based row number in `_row`."""
    path = Path(path)
    text = read_text(path)
    rows = read_json_lines(path, text) if path.suffix in (".jsonl", ".json") else read_csv(path, text)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def read_json_lines(path: Path, text: str) -> list[dict]:
    rows = []
    for number, line in enumerate(text.split("\n"), start=1):  # not splitlines(): a string may hold U+2028, \f, ...
        if line.strip():
            try:
                row = json.loads(line)
            except ValueError as error:
                raise DataError(f"{path}: row {number}: not a JSON object ({error})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}: row {number}: not a JSON object")
            rows.append({**row, "_row": number})
    return rows


def read_csv(path: Path, text: str) -> list[dict]:
    """The header is row 1, so the first record is row 2: what a spreadsheet shows, whatever line breaks its quoted
    cells hold. Strict: an unclosed quote is an error, not a cell that swallows the rest of the file."""
    records = csv.DictReader(io.StringIO(text, newline=""), strict=True)
    rows = []
    while True:
        line = records.line_num + 1
        try:
            row = next(records, None)
        except csv.Error as error:
            raise DataError(f"{path}: line {line}: not valid CSV ({error})") from None
        if row is None:
            return rows
        if None in row:  # csv's key for fields beyond the header's
            raise DataError(
                f"{path}: row {len(rows) + 2}: more fields than the header has ({len(row[None])} "
                f"extra; is a comma inside an unquoted field?)"
            )
        rows.append({**row, "_row": len(rows) + 2})


def is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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

    name: str
    model_class: str
    columns: tuple
    metric: str
    optional: tuple = ()

    def labels(self, rows) -> list[str]:
        if self.name == "text-classification":
            return sorted({str(row["label"]) for row in rows})
        if self.name == "token-classification":
            return sorted({str(tag) for row in rows for tag in as_list(row["tags"])})
        return []

    def encode(self, rows, path, tokenizer, label2id, max_length, positions=None) -> list[dict]:
        """Every row's features; `positions` (the model's learned position embeddings) caps their length."""
        encoded = []
        for row in rows:
            features = getattr(self, "_encode_" + self.name.replace("-", "_"))(
                row, path, tokenizer, label2id, max_length
            )
            if positions is not None and len(features["input_ids"]) > positions:
                raise DataError(
                    f"{path}: row {row['_row']}: {len(features['input_ids'])} tokens, more than the "
                    f"model's {positions} positions (max_position_embeddings); use a max_length of at "
                    f"most {positions}"
                )
            encoded.append(features)
        return encoded

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
    "text-classification": Task(
        "text-classification",
        "EncoderStackForSequenceClassification",
        ("text", "label"),
        "accuracy",
        optional=("text_pair",),
    ),
    "token-classification": Task(
        "token-classification", "EncoderStackForTokenClassification", ("tokens", "tags"), "f1"
    ),
    "question-answering": Task(
        "question-answering",
        "EncoderStackForQuestionAnswering",
        ("question", "context", "answer"),
        "exact_match",
        optional=("answer_start",),
    ),
}


def collator(task: Task, tokenizer, packing: bool = False):
    """Padding to each batch's longest row, or with `packing`, the batch as one flattened row (no padding at all):
    transformers' `DataCollatorWithFlattening`, for token-level tasks (it carries token labels only)."""
    if packing:
        return transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)
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


def check_settings(epochs, batch_size, learning_rate, max_length, seed, gradient_accumulation_steps) -> None:
    """Numbers Trainer would accept and then train nothing, or NaN, from."""
    for name, value in (("epochs", epochs), ("learning_rate", learning_rate)):
        if not (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
            raise FinetuneError(f"{name} must be a positive finite number, got {value!r}")
    for name, value in (
        ("batch_size", batch_size),
        ("max_length", max_length),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
    ):
        if not (is_integer(value) and value > 0):
            raise FinetuneError(f"{name} must be a positive integer, got {value!r}")
    if not (is_integer(seed) and 0 <= seed < 2**32):
        raise FinetuneError(f"seed must be an integer in [0, 2**32), got {seed!r}")


def model_config(model) -> dict:
    """The config.json of an EncoderStack or BERT folder that has a tokenizer: checked before anything is loaded."""
    folder = Path(model)
    if not folder.is_dir():
        raise FinetuneError(f"{folder}: no such model folder")
    config = read_json_object(folder / "config.json", FinetuneError)
    if config.get("model_type") != "encoderstack" and config.get("model_type") not in FAMILIES:
        raise FinetuneError(
            f"{folder / 'config.json'}: model_type {config.get('model_type')!r} is not an EncoderStack or BERT model"
        )
    if not has_tokenizer(folder):
        raise FinetuneError(
            f"{folder}: no tokenizer ({' or '.join(TOKENIZER_FILES)}); fine-tuning takes the "
            f"tokenizer from the model folder"
        )
    return config


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


def check_weights(model, error: type[Exception] = FinetuneError) -> None:
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
        raise FinetuneError(f"{model}: the tokenizer does not load ({' '.join(str(error).split())})") from None
    if len(tokenizer) > config.get("vocab_size", len(tokenizer)):
        raise FinetuneError(
            f"{model}: the tokenizer has {len(tokenizer)} tokens but the model only "
            f"{config['vocab_size']} embeddings (vocab_size in config.json)"
        )
    return tokenizer


def finetune(
    model,
    output,
    task="text-classification",
    train=DATA / "train.csv",
    eval=None,
    epochs=3.0,
    batch_size=16,
    learning_rate=1e-4,
    max_length=128,
    seed=42,
    gradient_accumulation_steps=1,
    force=False,
    packing=False,
    **training_args,
) -> dict:
    """Fine-tune `model` (an EncoderStack or BERT folder) on `train`, keep the best checkpoint by `eval`, and
    write it to `output` with its tokenizer, `finetune.json` (data, settings, metrics) and `loss.png`. `eval`
    defaults to the shipped held-out set only when `train` is the shipped training set.

    Settings, model folder and data are all checked before any model is loaded (FinetuneError, DataError)."""
    check_settings(epochs, batch_size, learning_rate, max_length, seed, gradient_accumulation_steps)
    try:
        import matplotlib  # noqa: F401  (fail before training, not after it)
    except ImportError:
        raise FinetuneError("the loss plot needs matplotlib: pip install 'encoderstack[plots]'") from None
    if task not in TASKS:
        raise FinetuneError(f"unknown task {task!r}; choose from {', '.join(TASKS)}")
    if packing and task != "token-classification":
        raise FinetuneError(
            f"packing flattens each batch into one row with token labels only; {task} needs "
            "per-sequence labels or span positions the flattening collator does not carry"
        )
    if eval is None:
        if Path(train) != DATA / "train.csv":  # scoring your data's model on the shipped reviews would look plausible
            raise FinetuneError(f"{train}: no evaluation data given for it (eval, --eval)")
        eval = DATA / "dev.csv"
    # before any work: the output is usable, and no input lies where the run writes, replaces or deletes
    destination = OutputFolder(output, force, inputs=[model, train, eval], siblings=["checkpoints"])
    spec = TASKS[task]
    config = model_config(model)
    train_rows, eval_rows = read_rows(train), read_rows(eval)
    require(train_rows, train, spec.columns, spec.optional)
    require(eval_rows, eval, spec.columns, spec.optional)
    labels = spec.labels(train_rows)
    if spec.name != "question-answering" and len(labels) < 2:  # one label: Trainer would fit a regression
        raise DataError(f"{train}: every row has the label {labels[0]!r}; a classifier needs at least two")
    labels = training_labels(config, model, spec, labels)
    check_weights(model)
    label2id = {label: i for i, label in enumerate(labels)}
    tokenizer = load_tokenizer(model, config)
    absolute = config.get("position_embedding_type", "absolute") == "absolute"
    positions = config.get("max_position_embeddings") if absolute else None
    train_set = spec.encode(train_rows, train, tokenizer, label2id, max_length, positions)
    # Shuffled once here and then read in order, so that the batches do not depend on the number of processes:
    # N processes with batch b reproduce one process with batch N*b (Trainer's samplers differ between the two).
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed)).tolist()
    train_set = [train_set[i] for i in order]
    eval_set = spec.encode(eval_rows, eval, tokenizer, label2id, max_length, positions)

    checkpoints = destination.sibling("checkpoints")
    try:
        args = transformers.TrainingArguments(
            output_dir=str(checkpoints),
            num_train_epochs=epochs,
            per_device_train_batch_size=batch_size,
            per_device_eval_batch_size=batch_size,
            learning_rate=learning_rate,
            warmup_steps=0.1,
            weight_decay=0.01,
            seed=seed,
            gradient_accumulation_steps=gradient_accumulation_steps,
            eval_strategy="epoch",
            save_strategy="epoch",
            load_best_model_at_end=True,
            metric_for_best_model=spec.metric,
            save_total_limit=1,
            train_sampling_strategy="sequential",
            logging_steps=max(1, math.ceil(len(train_set) / batch_size / 4)),
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            **training_args,
        )
    except ValueError as error:  # an optimizer name, a precision this machine lacks, ...
        raise FinetuneError(f"training settings: {' '.join(str(error).split())}") from None
    transformers.set_seed(seed)
    label_config = (
        {"num_labels": len(labels), "id2label": dict(enumerate(labels)), "label2id": label2id} if labels else {}
    )
    with terminating_signals_raise():  # SIGTERM, too, ends in the `finally` that removes the checkpoints
        try:
            network = getattr(modeling_encoderstack, spec.model_class).from_pretrained(model, **label_config)
            return train_and_save(
                network,
                tokenizer,
                args,
                spec,
                train_set,
                eval_set,
                destination,
                {
                    "task": task,
                    "base_model": str(model),
                    "train": str(train),
                    "eval": str(eval),
                    "train_rows": len(train_set),
                    "eval_rows": len(eval_set),
                    "labels": labels,
                    "settings": {
                        "epochs": epochs,
                        "batch_size": batch_size,
                        "learning_rate": learning_rate,
                        "gradient_accumulation_steps": gradient_accumulation_steps,
                        "max_length": max_length,
                        "seed": seed,
                        "world_size": args.world_size,
                        "packing": packing,
                    },
                },
                packing,
            )
        finally:  # the best checkpoint is in `output` by now, or the run failed: either way the rest is scratch
            if args.should_save:
                shutil.rmtree(checkpoints, ignore_errors=True)


def train_and_save(
    network,
    tokenizer,
    args,
    spec: Task,
    train_set,
    eval_set,
    destination: OutputFolder,
    record: dict,
    packing: bool = False,
) -> dict:
    trainer = transformers.Trainer(
        model=network,
        args=args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        data_collator=collator(spec, tokenizer, packing),
        compute_metrics=spec.metrics,
        callbacks=[TiesToTheLowerLoss(spec.metric)],
    )
    # The starting point is scored after training, on a copy: under DDP (transformers 5.24) a Trainer.evaluate()
    # before train() changes what the processes then train (measured: 3e-2 off the one-process weights).
    baseline = copy.deepcopy(network)
    trainer.train()
    history = list(trainer.state.log_history)
    after = trainer.evaluate()  # the best checkpoint, reloaded by load_best_model_at_end
    before = transformers.Trainer(
        model=baseline,
        args=args,
        eval_dataset=eval_set,
        data_collator=collator(spec, tokenizer, packing),
        compute_metrics=spec.metrics,
    ).evaluate()
    del baseline
    record = {
        **record,
        "before": scores(before),
        "after": scores(after),
        "best_checkpoint_step": int(Path(trainer.state.best_model_checkpoint).name.split("-")[-1]),
    }
    if trainer.is_world_process_zero():
        with destination as folder:
            trainer.save_model(folder)
            tokenizer.save_pretrained(folder)
            (folder / "finetune.json").write_text(json.dumps(record, indent=2) + "\n")
            plot_losses(history, folder / "loss.png")
            write_card(folder, repo_id=destination.path.name)
    return record

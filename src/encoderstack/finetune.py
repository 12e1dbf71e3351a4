"""`encoderstack finetune`: fine-tune an EncoderStack (or BERT) checkpoint with transformers' Trainer.

Data is CSV or JSON lines, checked row by row before any training starts. Runs the same under `torchrun` and
`accelerate launch` (Trainer does the data parallelism); only the main process writes the results.
"""

import copy
import csv
import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import transformers

from .hub_card import write_card
from .output_folder import OutputFolder

DATA = Path(__file__).parent / "data" / "sentiment"


class DataError(ValueError):
    """Training or evaluation data that cannot be used; the message names the file and the row."""


def read_rows(path) -> list[dict]:
    """Rows of a CSV file (with a header) or a JSON-lines file, each with its 1-based row number in `_row`."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as error:
        raise DataError(f"{path}: cannot read ({error.strerror})") from None
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for number, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError as error:
                    raise DataError(f"{path}: row {number}: not a JSON object ({error})") from None
                if not isinstance(row, dict):
                    raise DataError(f"{path}: row {number}: not a JSON object")
                rows.append({**row, "_row": number})
    else:  # the header is line 1, so the first record is row 2: what a spreadsheet shows
        rows = [{**row, "_row": number} for number, row in enumerate(csv.DictReader(text.splitlines()), start=2)]
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def require(rows, path, columns) -> None:
    for row in rows:
        for column in columns:
            if row.get(column) in (None, ""):
                raise DataError(f"{path}: row {row['_row']}: missing column {column!r}")


def as_list(value) -> list:
    return value if isinstance(value, list) else str(value).split()


@dataclass
class Task:
    """How one kind of task reads its rows, encodes them and scores predictions."""

    name: str
    model_class: str
    columns: tuple
    metric: str

    def labels(self, rows) -> list[str]:
        if self.name == "text-classification":
            return sorted({str(row["label"]) for row in rows})
        if self.name == "token-classification":
            return sorted({str(tag) for row in rows for tag in as_list(row["tags"])})
        return []

    def encode(self, rows, path, tokenizer, label2id, max_length) -> list[dict]:
        return [getattr(self, "_encode_" + self.name.replace("-", "_"))(row, path, tokenizer, label2id, max_length)
                for row in rows]

    def _label_id(self, label, row, path, label2id):
        if str(label) not in label2id:
            raise DataError(f"{path}: row {row['_row']}: unknown label {label!r} (training labels: "
                            f"{', '.join(label2id)})")
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
            labels.append(-100 if word is None or word == previous else
                          self._label_id(tags[word], row, path, label2id))
            previous = word
        return {**features, "labels": labels}

    def _encode_question_answering(self, row, path, tokenizer, label2id, max_length):
        context, answer = str(row["context"]), str(row["answer"])
        start = int(row["answer_start"]) if row.get("answer_start") not in (None, "") else context.find(answer)
        if start < 0 or context[start : start + len(answer)] != answer:
            raise DataError(f"{path}: row {row['_row']}: the answer {answer!r} is not in the context")
        features = tokenizer(str(row["question"]), context, truncation="only_second", max_length=max_length,
                             return_offsets_mapping=True)
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
    "text-classification": Task("text-classification", "EncoderStackForSequenceClassification",
                                ("text", "label"), "accuracy"),
    "token-classification": Task("token-classification", "EncoderStackForTokenClassification",
                                 ("tokens", "tags"), "f1"),
    "question-answering": Task("question-answering", "EncoderStackForQuestionAnswering",
                               ("question", "context", "answer"), "exact_match"),
}


def collator(task: Task, tokenizer):
    if task.name == "token-classification":
        return transformers.DataCollatorForTokenClassification(tokenizer)
    return transformers.DataCollatorWithPadding(tokenizer)


def scores(evaluation: dict) -> dict:
    timings = ("runtime", "samples_per_second", "steps_per_second", "model_preparation_time")
    return {k.removeprefix("eval_"): v for k, v in evaluation.items()
            if k.startswith("eval_") and k.removeprefix("eval_") not in timings}


def plot_losses(log_history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5), dpi=100)
    for key, label in (("loss", "training"), ("eval_loss", "evaluation")):
        points = [(entry["step"], entry[key]) for entry in log_history if key in entry]
        if points:
            axes.plot(*zip(*points), marker="o" if key == "eval_loss" else None, label=label)
    axes.set(xlabel="step", ylabel="loss", title="Fine-tuning loss")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def finetune(model, output, task="text-classification", train=DATA / "train.csv", eval=DATA / "dev.csv",
             epochs=3.0, batch_size=16, learning_rate=1e-4, max_length=128, seed=42,
             gradient_accumulation_steps=1, force=False, **training_args) -> dict:
    """Fine-tune `model` (an EncoderStack or BERT folder) on `train`, keep the best checkpoint by `eval`, and
    write it to `output` with its tokenizer, `finetune.json` (data, settings, metrics) and `loss.png`."""
    import encoderstack

    try:
        import matplotlib  # noqa: F401  (fail before training, not after it)
    except ImportError:
        raise DataError("the loss plot needs matplotlib: pip install 'encoderstack[plots]'") from None
    destination = OutputFolder(output, force, inputs=[model, train, eval])  # before any work: the output is usable
    spec = TASKS[task]
    train_rows, eval_rows = read_rows(train), read_rows(eval)
    require(train_rows, train, spec.columns)
    require(eval_rows, eval, spec.columns)
    labels = spec.labels(train_rows)
    label2id = {label: i for i, label in enumerate(labels)}
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    train_set = spec.encode(train_rows, train, tokenizer, label2id, max_length)
    # Shuffled once here and then read in order, so that the batches do not depend on the number of processes:
    # N processes with batch b reproduce one process with batch N*b (Trainer's samplers differ between the two).
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed)).tolist()
    train_set = [train_set[i] for i in order]
    eval_set = spec.encode(eval_rows, eval, tokenizer, label2id, max_length)

    transformers.set_seed(seed)
    label_config = {"num_labels": len(labels), "id2label": dict(enumerate(labels)), "label2id": label2id} if labels else {}
    network = getattr(encoderstack, spec.model_class).from_pretrained(model, **label_config)
    args = transformers.TrainingArguments(
        output_dir=str(destination.path.parent / f".{destination.path.name}.checkpoints"),
        num_train_epochs=epochs, per_device_train_batch_size=batch_size, per_device_eval_batch_size=batch_size,
        learning_rate=learning_rate, warmup_steps=0.1, weight_decay=0.01, seed=seed,
        gradient_accumulation_steps=gradient_accumulation_steps, eval_strategy="epoch", save_strategy="epoch",
        load_best_model_at_end=True, metric_for_best_model=spec.metric, save_total_limit=1,
        train_sampling_strategy="sequential",
        logging_steps=max(1, math.ceil(len(train_set) / batch_size / 4)), report_to=[], use_cpu=not torch.cuda.is_available(),
        **training_args,
    )
    trainer = transformers.Trainer(model=network, args=args, train_dataset=train_set, eval_dataset=eval_set,
                                   data_collator=collator(spec, tokenizer), compute_metrics=spec.metrics)
    # The starting point is scored after training, on a copy: under DDP (transformers 5.24) a Trainer.evaluate()
    # before train() changes what the processes then train (measured: 3e-2 off the one-process weights).
    baseline = copy.deepcopy(network)
    trainer.train()
    history = list(trainer.state.log_history)
    after = trainer.evaluate()  # the best checkpoint, reloaded by load_best_model_at_end
    before = transformers.Trainer(model=baseline, args=args, eval_dataset=eval_set, data_collator=collator(spec, tokenizer),
                                  compute_metrics=spec.metrics).evaluate()
    del baseline
    record = {
        "task": task, "base_model": str(model), "train": str(train), "eval": str(eval),
        "train_rows": len(train_set), "eval_rows": len(eval_set), "labels": labels,
        "settings": {"epochs": epochs, "batch_size": batch_size, "learning_rate": learning_rate,
                     "gradient_accumulation_steps": gradient_accumulation_steps, "max_length": max_length,
                     "seed": seed, "world_size": args.world_size},
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
        shutil.rmtree(args.output_dir, ignore_errors=True)
    return record

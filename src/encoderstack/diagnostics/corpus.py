"""`diagnose --corpus`: the placement comparison on real text, through `encoderstack pretrain`'s own path: its
documents read into `datasets`, a WordPiece tokenizer trained on them, sequences cut to `MAX_LENGTH`, each masked on
its own and flattened into one row, a fresh model built from config fields, its Trainer settings."""

import copy
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers

from ..checkpoint import sha256
from ..data.stdlib import stdlib_corpus
from ..pretrain import (
    EVAL_MASK_SEED,
    PretrainTrainingArguments,
    mlm_trainer,
    padded_ids,
    prepare_text,
    starting_model,
    text_files,
)
from .synthetic import diagnostic_fields

STDLIB = "stdlib"  # --corpus stdlib: stdlib_corpus, built at run time
MAX_LENGTH = 64
BATCH_SIZE = 32
VOCAB_SIZE = 2000
MLM_PROBABILITY = 0.15
MEASUREMENT_SEQUENCES = 32


@dataclass
class CorpusText:
    """The prepared text: pretrain's tokenizer and datasets, its data record, and the fixed measurement batch."""

    name: str
    tokenizer: transformers.PreTrainedTokenizerBase
    train_set: object
    eval_set: object
    data: dict
    batch: dict


@contextmanager
def corpus_text(corpus: str, where: Path, seed: int) -> Iterator[CorpusText]:
    """`corpus` (a .txt/.jsonl file or folder, or `STDLIB`) prepared by pretrain's data path in a hidden temporary
    folder under `where`, which lives as long as the datasets are used. Bad text raises DataError first."""
    with tempfile.TemporaryDirectory(prefix=".encoderstack-diagnose-", dir=where) as scratch:
        scratch = Path(scratch)
        path = stdlib_corpus(scratch / "stdlib.txt") if corpus == STDLIB else Path(corpus)
        files = {f: sha256(f) for f in text_files(path)}
        tokenizer, train_set, eval_set, data = prepare_text(
            files,
            {},
            train=path,
            cache=scratch / "data",
            train_tokenizer=VOCAB_SIZE,
            max_length=MAX_LENGTH,
            mlm_probability=MLM_PROBABILITY,
            seed=seed,
        )
        if corpus == STDLIB:  # the file lived in the scratch folder; what identifies it is the Python that wrote it
            data["train"][0]["file"] = f"stdlib.txt (stdlib_corpus of Python {sys.version.split()[0]})"
        data["corpus"] = corpus
        batch = padded_batch(eval_set[:MEASUREMENT_SEQUENCES], tokenizer.pad_token_id)
        yield CorpusText(corpus, tokenizer, train_set, eval_set, data, batch)


def padded_batch(rows: dict, pad_token_id: int) -> dict:
    """Masked evaluation sequences as one padded batch: the measurements read per-layer streams on the padded path."""
    input_ids, attention_mask = padded_ids(rows["input_ids"], pad_token_id)
    return {"input_ids": input_ids, "labels": padded_ids(rows["labels"], -100)[0], "attention_mask": attention_mask}


def pretrain_settings(steps: int, lr: float, warmup_steps: int, seed: int, scratch: Path, batch_size: int = BATCH_SIZE):
    """pretrain's Trainer settings for a comparison run: a constant learning rate after a linear warm-up, as the
    synthetic runs; no checkpoints or evaluations during the run, the loss of every step (NaN/inf kept, not filtered
    out) and no gradient clipping, which would hide the instability the comparison looks for."""
    return PretrainTrainingArguments(
        output_dir=str(scratch),
        max_steps=steps,
        per_device_train_batch_size=batch_size,
        per_device_eval_batch_size=batch_size,
        learning_rate=lr,
        warmup_steps=warmup_steps,
        lr_scheduler_type="constant",
        seed=seed,
        eval_strategy="no",
        save_strategy="no",
        load_best_model_at_end=False,
        logging_steps=1,
        logging_nan_inf_filter=False,
        max_grad_norm=0.0,
        disable_tqdm=True,
    )


class StepLosses(transformers.TrainerCallback):
    """Every step's training loss; a non-finite one stops the run there, as in the synthetic runs."""

    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(float(logs["loss"]))
            if not torch.isfinite(torch.tensor(self.losses[-1])):
                control.should_training_stop = True


def comparison_trainer(model, text: CorpusText, args, callbacks=()) -> transformers.Trainer:
    """pretrain's Trainer with the settings of `pretrain_settings`, silent: the comparison reports its own progress."""
    trainer = mlm_trainer(
        model, args, text.tokenizer, text.train_set, text.eval_set, MLM_PROBABILITY, False, callbacks=list(callbacks)
    )
    trainer.remove_callback(transformers.PrinterCallback)  # disable_tqdm: Trainer would print every step's log
    return trainer


def initial_model(placement: str, num_layers: int, hidden_size: int, text: CorpusText, seed: int, **fields):
    """A fresh model as pretrain builds one from config fields (seeded, then `starting_model`); `fields` override
    the diagnostic ones."""
    transformers.set_seed(seed)
    fields = {**diagnostic_fields(placement, num_layers, hidden_size), **fields}
    return starting_model(None, fields, text.tokenizer, text.train_set)[0]


def text_trainer(
    text: CorpusText, steps: int, lr: float, seed: int, scratch: Path, callbacks=(), batch_size: int = BATCH_SIZE
):
    """`train(model, warmup_steps) -> (losses, trained model)` and `evaluate(model) -> eval masked-LM loss` on
    `text`; each training run works on a copy, so that both schedules start from the same weights. `callbacks` join
    every training run's Trainer."""

    def train(model, warmup_steps: int):
        losses = StepLosses()
        trainer = comparison_trainer(
            copy.deepcopy(model),
            text,
            pretrain_settings(steps, lr, warmup_steps, seed, scratch, batch_size),
            [losses, *callbacks],
        )
        trainer.train()
        return losses.losses, trainer.model.eval()

    def evaluate(model) -> float:
        trainer = comparison_trainer(model, text, pretrain_settings(steps, lr, 0, seed, scratch, batch_size))
        return trainer.evaluate()["eval_mlm_loss"]

    return train, evaluate


def describe(text: CorpusText, batch_size: int = BATCH_SIZE) -> str:
    data = text.data
    files = ", ".join(f"`{entry['file']}` (sha256 `{entry['sha256'][:12]}…`)" for entry in data["train"])
    source = (
        "the prose of the installed Python's standard-library docstrings "
        "(`encoderstack.diagnostics.corpus.stdlib_corpus`, PSF licence)"
        if text.name == STDLIB
        else f"`{text.name}`"
    )
    return (
        f"**Corpus**: {source}: {files}. Read, split and tokenized by `encoderstack pretrain`'s data path: a "
        f"held-out tenth of the documents for evaluation ({data['eval']}), a lower-cased WordPiece tokenizer of "
        f"{len(text.tokenizer)} tokens trained on the training documents, each document's tokens cut into "
        f"sequences of at most {MAX_LENGTH} (`[CLS] ... [SEP]`). Training text: {data['train_sequences']} "
        f"sequences, {data['train_tokens']} tokens; evaluation text: {data['eval_sequences']} sequences, "
        f"{data['eval_tokens']} tokens, {data['eval_masked_tokens']} of them masked (once, seed "
        f"{EVAL_MASK_SEED}). Each training batch is {batch_size} sequences, each masked on its own "
        f"({MLM_PROBABILITY:.0%}, BERT's 80/10/10), flattened into one row without padding. The measurements use "
        f"the first {len(text.batch['input_ids'])} masked evaluation sequences, padded into one batch."
    )

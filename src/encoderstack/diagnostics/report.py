"""`run_report`: every measurement for each placement and depth, written as `index.md`, PNG figures and
`results.json` into a folder that appears only when complete."""

import json
import math
import os
import time
from collections.abc import Callable
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

from ..configuration_encoderstack import NORM_PLACEMENTS
from ..modeling_encoderstack import PLACEMENTS
from ..output_folder import OutputFolder
from .corpus import STDLIB, CorpusText, corpus_text, describe, initial_model, text_trainer
from .measure import activation_rms_per_layer, consecutive_layer_similarity, gradient_norms_per_layer
from .plots import require_matplotlib, write_figures
from .synthetic import (
    HALF_LENGTH,
    MASK_FRACTION,
    NUM_CONTENT,
    SUCCESSORS,
    SyntheticMLMTask,
    build_masked_lm,
    diagnostic_config,
    divergence,
    final_loss,
    train_synthetic_mlm,
)

MEASUREMENT_BATCH_SIZE = 32
TRAINING_BATCH_SIZE = 32
WARMUP_FRACTION = 0.2


def one_name_per_row(names) -> tuple[str, ...]:
    """`names` without the aliases of an earlier one (`peri` is `sandwich`'s row): each model trained once."""
    rows = {}
    for name in names:
        rows.setdefault(id(PLACEMENTS[name]), name)
    return tuple(rows.values())


@dataclass(frozen=True)
class ReportSettings:
    layers: tuple[int, ...] = (6, 24, 48)
    placements: tuple[str, ...] = one_name_per_row(NORM_PLACEMENTS)
    steps: int = 150
    hidden_size: int = 64
    lr: float = 1e-3
    seed: int = 0
    warmup: int | None = None  # steps of the warm-up runs' linear warm-up; None: WARMUP_FRACTION of the steps
    corpus: str | None = None  # real text (see diagnostics.corpus) instead of the synthetic task

    def __post_init__(self):
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")

    @property
    def warmup_steps(self) -> int:
        return round(WARMUP_FRACTION * self.steps) if self.warmup is None else self.warmup

    @property
    def command(self) -> str:
        warmup = "" if self.warmup is None else f" --warmup-steps {self.warmup}"
        corpus = "" if self.corpus is None else f" --corpus {self.corpus}"
        return (
            f"encoderstack diagnose --layers {','.join(map(str, self.layers))} "
            f"--placements {','.join(self.placements)} --steps {self.steps} --hidden-size {self.hidden_size} "
            f"--lr {self.lr:g} --seed {self.seed}{warmup}{corpus}"
        )


QUICK = ReportSettings(layers=(2, 6), steps=40, hidden_size=32)


def measure_placement(
    placement: str,
    num_layers: int,
    initial,
    batch: dict,
    train: Callable,
    warmup_steps: int,
    evaluate: Callable | None = None,
) -> dict:
    """All measurements of one initialization on `batch`, then of `train(initial, warmup)` (-> losses, trained
    model) with and without warm-up; with `evaluate` (model -> loss), the evaluation loss of each of them."""
    result = {
        "placement": placement,
        "num_layers": num_layers,
        "gradient_norms": gradient_norms_per_layer(initial, batch),
        "activation_rms": {"init": activation_rms_per_layer(initial, batch)},
        "similarity": {"init": consecutive_layer_similarity(initial, batch)},
        "losses": {},
    }
    if evaluate is not None:
        result["eval_loss"] = {"init": evaluate(initial)}
    for schedule, warmup in (("warmup", warmup_steps), ("no_warmup", 0)):
        result["losses"][schedule], model = train(initial, warmup)
        result["activation_rms"][schedule] = activation_rms_per_layer(model, batch)
        result["similarity"][schedule] = consecutive_layer_similarity(model, batch)
        if evaluate is not None:
            result["eval_loss"][schedule] = evaluate(model)
    return result


def diagnose_placement(placement: str, num_layers: int, settings: ReportSettings) -> dict:
    """The synthetic task's measurements of one config."""
    config = diagnostic_config(placement, num_layers, settings.hidden_size)
    batch = SyntheticMLMTask().sample(MEASUREMENT_BATCH_SIZE, torch.Generator().manual_seed(settings.seed))

    def train(initial, warmup_steps):
        run = train_synthetic_mlm(
            config, settings.steps, settings.lr, warmup_steps, settings.seed, batch_size=TRAINING_BATCH_SIZE
        )
        return run.losses, run.model

    return measure_placement(
        placement, num_layers, build_masked_lm(config, settings.seed), batch, train, settings.warmup_steps
    )


def diagnose_on_text(placement: str, num_layers: int, settings: ReportSettings, text: CorpusText, scratch) -> dict:
    """The real text's measurements of one config, trained and evaluated through pretrain's path."""
    train, evaluate = text_trainer(text, settings.steps, settings.lr, settings.seed, scratch)
    initial = initial_model(placement, num_layers, settings.hidden_size, text, settings.seed)
    return measure_placement(placement, num_layers, initial, text.batch, train, settings.warmup_steps, evaluate)


@contextmanager
def single_threaded():
    """Models this small spend their time in per-op overhead, where a second thread only adds contention (a step at
    6 layers: 0.06 s on one thread, 1.2 s on two, on a shared 2-core machine); one thread also keeps the numbers
    independent of the core count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def run_report(
    out, settings: ReportSettings = ReportSettings(), force: bool = False, progress: Callable[[str], None] | None = None
) -> Path:
    """Measure every placement at every depth and write the report folder `out`; returns its path.

    An existing `out` is refused unless `force`, before any work; the folder is built in a hidden sibling and
    renamed into place at the end.
    """
    require_matplotlib()
    output = OutputFolder(out, force, inputs=[settings.corpus] if settings.corpus != STDLIB else [])
    results, began = [], time.perf_counter()
    with single_threaded(), ExitStack() as stack:
        text = None
        if settings.corpus is not None:
            work = stack.enter_context(output.scratch("work"))  # removed on a terminating signal too
            text = stack.enter_context(corpus_text(settings.corpus, work, settings.seed))
            scratch = stack.enter_context(TemporaryDirectory(prefix=".encoderstack-trainer-", dir=work))
        for num_layers in settings.layers:
            for placement in settings.placements:
                start = time.perf_counter()
                results.append(
                    diagnose_placement(placement, num_layers, settings)
                    if text is None
                    else diagnose_on_text(placement, num_layers, settings, text, scratch)
                )
                if progress is not None:
                    progress(f"{placement:<10} {num_layers:>3} layers  {time.perf_counter() - start:6.1f} s")
        elapsed = time.perf_counter() - began
        record = run_record(settings, elapsed, **({"data": text.data} if text else {}), results=results)
        with output as folder:
            write_figures(results, folder)
            (folder / "results.json").write_text(json.dumps(record) + "\n")
            (folder / "index.md").write_text(render_index(results, settings, text, elapsed))
    return output.path


def run_record(settings, elapsed: float, **fields) -> dict:
    """results.json: the settings, the wall clock and the machine, then `fields` (the measurements)."""
    return {
        "settings": asdict(settings),
        "wall_seconds": round(elapsed, 1),
        "threads": 1,
        "cpu_count": os.cpu_count(),
        **fields,
    }


def number(value: float) -> str:
    return f"{value:.3g}" if math.isfinite(value) else str(value)


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += [
        "| " + " | ".join(number(cell) if isinstance(cell, float) else str(cell) for cell in row) + " |" for row in rows
    ]
    return "\n".join(lines)


def stream_rows(results: list[dict], measurement: str, summary: Callable[[list[float]], float]) -> list[list]:
    """One row per result and stream (ResiDual adds a `d` row): the summary at init and after each training run."""
    rows = []
    for result in results:
        curves = result[measurement]
        for stream, label in (("hidden", result["placement"]), ("dual", f"{result['placement']} (d stream)")):
            if stream in curves["init"]:
                rows.append(
                    [
                        label,
                        result["num_layers"],
                        *(summary(curves[key][stream]) for key in ("init", "warmup", "no_warmup")),
                    ]
                )
    return rows


def upper_half_mean(values: list[float]) -> float:
    upper = values[len(values) // 2 :]
    return sum(upper) / len(upper)


SYNTHETIC_TASK = f"""**Synthetic masked-LM task** (ships with the command): sequences
`[CLS] x_1 .. x_{HALF_LENGTH} [SEP] p(x_1) .. p(x_{HALF_LENGTH}) [SEP]` over {NUM_CONTENT} content tokens, where
the x follow a fixed random bigram grammar ({SUCCESSORS} allowed successors per token) and p is a fixed random
permutation. {MASK_FRACTION:.0%} of the content tokens are replaced by `[MASK]` and predicted: a masked token is
predictable from its neighbours and, unless its partner is masked too, exactly from its partner in the other half.
The measurements use one fixed batch of {MEASUREMENT_BATCH_SIZE} sequences."""


TOKENIZER_TIES = (
    ", except that `tokenizers` breaks ties between equally frequent WordPiece merges in hash order: "
    "another run can learn a slightly different vocabulary, hence slightly different numbers. Within "
    "one report every run reads the same tokens."
)


def training_text(settings: ReportSettings, text: CorpusText | None) -> str:
    if text is None:
        how = (
            f"AdamW (lr {settings.lr:g}, weight decay 0.01, no gradient clipping) on batches of "
            f"{TRAINING_BATCH_SIZE} sequences"
        )
    else:
        how = (
            f"`encoderstack pretrain`'s Trainer settings (AdamW, lr {settings.lr:g}, weight decay 0.01, seed "
            f"{settings.seed}, scheduler `constant`) but no gradient clipping and no checkpoints; the evaluation "
            "loss is the masked-LM loss over every masked token of the evaluation text"
        )
    return (
        f"**Training**: {settings.steps} steps of {how}. *Warm-up*: the learning rate rises linearly over the "
        f"first {settings.warmup_steps} steps, then stays constant; *no warm-up*: constant from the first step. "
        "A run **diverged** when its loss becomes NaN/inf (the run stops there) or its final loss (the mean of the "
        "last tenth of the steps) is above its first."
    )


def render_index(
    results: list[dict], settings: ReportSettings, text: CorpusText | None = None, elapsed: float | None = None
) -> str:
    schedules = ["at init", "trained, warm-up", "trained, no warm-up"]
    gradient_rows = [
        [
            r["placement"],
            r["num_layers"],
            r["gradient_norms"][0],
            r["gradient_norms"][-1],
            r["gradient_norms"][-1] / r["gradient_norms"][0],
        ]
        for r in results
    ]
    evaluated = text is not None
    training_rows = [
        [
            r["placement"],
            r["num_layers"],
            schedule,
            r["losses"][key][0],
            final_loss(r["losses"][key]),
            *([r["eval_loss"]["init"], r["eval_loss"][key]] if evaluated else []),
            divergence(r["losses"][key]) or "no",
        ]
        for r in results
        for schedule, key in (("yes", "warmup"), ("no", "no_warmup"))
    ]
    training_header = [
        "placement",
        "layers",
        "warm-up",
        "first loss",
        "final loss",
        *(["eval loss at init", "eval loss after"] if evaluated else []),
        "diverged",
    ]
    budget = (
        ""
        if elapsed is None
        else (
            f"\nIt ran in {elapsed / 60:.1f} minutes of wall clock on one thread "
            f"(`torch.set_num_threads(1)`), on a machine with {os.cpu_count()} CPU cores."
        )
    )
    return f"""# Why normalization placement matters: diagnostics{" on real text" if evaluated else ""}

Written by `{settings.command}`.
Everything is seeded: the same command gives the same numbers (all of them are in `results.json`) with the same
torch build{TOKENIZER_TIES if evaluated else "."}{budget}

**Models**: `EncoderStackForMaskedLM` with hidden size {settings.hidden_size}, 4 heads, FFN {4 * settings.hidden_size},
rotary positions, BERT's initialization (DeepNorm: with its beta gain and alpha residual scale), and
`hidden_dropout_prob=0`, `attention_probs_dropout_prob=0`. Each placement and depth has one seeded initialization:
it is measured, then trained twice from there.

{SYNTHETIC_TASK if text is None else describe(text)}

{training_text(settings, text)}

## 1. Gradient norm per layer at initialization

The L2 norm of all of layer i's parameter gradients after one masked-LM backward pass on the fixed batch.

![gradient norm per layer](gradient_norms.png)

{markdown_table(["placement", "layers", "layer 1", "last layer", "last / first"], gradient_rows)}

## 2. Activation scale per layer

RMS (over real tokens and features) of the stream after the embeddings (layer 0) and after each layer, as the next
layer reads it, before any final norm; for `resi_dual` both the `a` stream (solid) and the un-normalized `d`
stream (dashed).

![activation RMS per layer](activation_rms.png)

RMS after the last layer:

{markdown_table(["placement", "layers", *schedules], stream_rows(results, "activation_rms", lambda v: v[-1]))}

## 3. Representation similarity across depth

Mean over real tokens of the cosine similarity between the representations before and after layer i. Values near 1
in the upper layers mean that those layers hardly change the representation: the signal of representation collapse.

![similarity of consecutive layers](layer_similarity.png)

Mean over the upper half of the layers:

{markdown_table(["placement", "layers", *schedules], stream_rows(results, "similarity", upper_half_mean))}

## 4. Training on {"the synthetic task" if text is None else "the corpus"}

![training loss](loss_curves.png)

{markdown_table(training_header, training_rows)}
"""

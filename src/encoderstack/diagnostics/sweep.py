"""`diagnose --corpus ... --sweep`: the placements of deep, narrow stacks trained on real text over a grid of
learning rates, with and without warm-up, several seeds per cell; per placement and depth: how often a run diverges,
its final evaluation loss, its gradient norm over depth and its layer redundancy (the angular distance between
consecutive layers' outputs). Every finished run is handed to `progress` as one JSON line as soon as it ends, and a
time budget stops the grid between runs, so that a cut-short sweep still writes its report."""

import json
import math
import os
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from tempfile import TemporaryDirectory

import torch
import transformers

from ..output_folder import OutputFolder
from .corpus import STDLIB, CorpusText, corpus_text, describe, initial_model, text_trainer
from .measure import angular_distance_per_layer, gradient_norms_per_layer
from .report import WARMUP_FRACTION, markdown_table, number, run_record, single_threaded
from .synthetic import divergence, final_loss

SCHEDULES = (("warm-up", True), ("no warm-up", False))


@dataclass(frozen=True)
class SweepSettings:
    corpus: str = STDLIB
    placements: tuple[str, ...] = ("post", "pre", "deepnorm", "lns")
    layers: tuple[int, ...] = (24,)
    lrs: tuple[float, ...] = (1e-2, 1e-1)
    seeds: int = 3  # seeds seed, seed + 1, ...: each one initialization per placement and depth, and its batches
    seed: int = 0
    steps: int = 20
    warmup: int | None = None  # steps of the warm-up runs' linear warm-up; None: WARMUP_FRACTION of the steps
    hidden_size: int = 64
    heads: int = 2
    batch_size: int = 16  # half of the report's: the grid of docs/diagnostics/depth fits 50 minutes on one thread
    init_std: float | None = None  # initializer_range; None: hidden_size ** -0.5, a square projection's Xavier std
    budget_minutes: float | None = None  # no run starts after this much wall clock: the report covers those done

    def __post_init__(self):
        for lr in self.lrs:
            if not (math.isfinite(lr) and lr > 0):
                raise ValueError(f"every learning rate must be a positive finite number, got {lr}")
        if self.hidden_size % (2 * self.heads):
            raise ValueError(
                f"hidden size {self.hidden_size} does not split into {self.heads} heads of even size (rotary)"
            )

    @property
    def warmup_steps(self) -> int:
        return round(WARMUP_FRACTION * self.steps) if self.warmup is None else self.warmup

    @property
    def initializer_range(self) -> float:
        return self.hidden_size**-0.5 if self.init_std is None else self.init_std

    @property
    def command(self) -> str:
        options = [
            f"--corpus {self.corpus} --sweep",
            f"--layers {','.join(map(str, self.layers))}",
            f"--placements {','.join(self.placements)}",
            f"--lrs {','.join(f'{lr:g}' for lr in self.lrs)}",
            f"--seeds {self.seeds} --seed {self.seed}",
            f"--steps {self.steps}",
            *([f"--warmup-steps {self.warmup}"] if self.warmup is not None else []),
            f"--hidden-size {self.hidden_size} --heads {self.heads} --batch-size {self.batch_size}",
            *([f"--init-std {self.init_std:g}"] if self.init_std is not None else []),
            *([f"--budget-minutes {self.budget_minutes:g}"] if self.budget_minutes is not None else []),
        ]
        return "encoderstack diagnose " + " ".join(options)

    def grid(self):
        """(seed, layers, placement) for each initialization, seed-major: a sweep cut short has whole seeds first."""
        for seed in range(self.seed, self.seed + self.seeds):
            for num_layers in self.layers:
                for placement in self.placements:
                    yield seed, num_layers, placement


def on_device(batch: dict, model) -> dict:
    """The measurement batch where the model is (the Trainer moves a model to the accelerator when there is one)."""
    return {key: value.to(model.device) for key, value in batch.items()}


def measured(model, text: CorpusText) -> dict:
    batch = on_device(text.batch, model)
    return {
        "gradient_norms": gradient_norms_per_layer(model, batch),
        "angular_distance": angular_distance_per_layer(model, batch),
    }


class Deadline(transformers.TrainerCallback):
    """Stops a training run once `out_of_time()`: the time guard holds inside a run too."""

    def __init__(self, out_of_time: Callable[[], bool]):
        self.out_of_time = out_of_time

    def on_step_end(self, args, state, control, **kwargs):
        if self.out_of_time():
            control.should_training_stop = True


def sweep_initialization(settings: SweepSettings, text: CorpusText, scratch: Path, key, out_of_time, emit) -> list:
    """One seeded initialization measured, then trained at every learning rate with and without warm-up; each
    record is emitted as it is made. Once `out_of_time()` no run starts, and a run it cuts short is left out."""
    seed, num_layers, placement = key
    cell = {"placement": placement, "num_layers": num_layers, "seed": seed}
    fields = {"num_attention_heads": settings.heads, "initializer_range": settings.initializer_range}
    initial = initial_model(placement, num_layers, settings.hidden_size, text, seed, **fields)
    records = [emit({**cell, "run": "init", **measured(initial, text)})]
    for lr in settings.lrs:
        train, evaluate = text_trainer(
            text, settings.steps, lr, seed, scratch, [Deadline(out_of_time)], settings.batch_size
        )
        for _, warm in SCHEDULES:
            if out_of_time():
                return records
            losses, model = train(initial, settings.warmup_steps if warm else 0)
            if out_of_time() and len(losses) < settings.steps and all(map(math.isfinite, losses)):
                return records
            record = {**cell, "run": "trained", "lr": lr, "warmup": warm, "losses": losses}
            record["diverged"] = divergence(losses)
            record["eval_loss"] = evaluate(model) if all(map(math.isfinite, losses)) else math.nan
            records.append(emit({**record, **measured(model, text)}))
    return records


def run_sweep(out, settings: SweepSettings, force: bool = False, progress: Callable[[str], None] | None = None) -> Path:
    """Run the grid and write `out` (index.md and results.json with every record); returns its path. Each record is
    also given to `progress` as `run {json}` as soon as it exists."""
    output = OutputFolder(out, force, inputs=[settings.corpus] if settings.corpus != STDLIB else [])
    began = time.perf_counter()
    budget = math.inf if settings.budget_minutes is None else 60 * settings.budget_minutes

    def out_of_time() -> bool:
        return time.perf_counter() - began > budget

    def emit(record: dict) -> dict:
        if progress is not None:
            progress("run " + json.dumps(record))
        return record

    records = []
    with single_threaded(), ExitStack() as stack:
        work = stack.enter_context(output.scratch("work"))
        text = stack.enter_context(corpus_text(settings.corpus, work, settings.seed))
        scratch = Path(stack.enter_context(TemporaryDirectory(prefix=".encoderstack-trainer-", dir=work)))
        for key in settings.grid():
            if out_of_time():
                break
            records += sweep_initialization(settings, text, scratch, key, out_of_time, emit)
        elapsed = time.perf_counter() - began
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        record = run_record(settings, elapsed, device=device, data=text.data, records=records)
        with output as folder:
            (folder / "results.json").write_text(json.dumps(record) + "\n")
            (folder / "index.md").write_text(
                render_sweep(records, settings, elapsed, describe(text, settings.batch_size))
            )
    return output.path


# ------------------------------------------------------------------------------------------------------- the report


def mean_spread(values: list[float]) -> str:
    finite = [value for value in values if math.isfinite(value)]
    if not finite:
        return "-"
    spread = statistics.stdev(finite) if len(finite) > 1 else 0.0
    return f"{statistics.mean(finite):.3f} ± {spread:.3f}"


def quarters(values: list[float]) -> list[float]:
    """The mean of each quarter of the layers (first to last); fewer than 4 layers: each layer."""
    count = min(4, len(values))
    bounds = [round(i * len(values) / count) for i in range(count + 1)]
    return [statistics.mean(values[a:b]) for a, b in zip(bounds, bounds[1:])]


def profile(records: list[dict], measurement: str) -> str:
    """Per depth quarter, the mean over the records (finite ones only) of `measurement`."""
    rows = [quarters(r[measurement]) for r in records if all(map(math.isfinite, r[measurement]))]
    if not rows:
        return "-"
    return " / ".join(number(statistics.mean(column)) for column in zip(*rows))


def trained_cells(records: list[dict], settings: SweepSettings):
    """(placement, layers, lr, schedule label, its records) for every cell with at least one finished run."""
    for num_layers in settings.layers:
        for placement in settings.placements:
            for lr in settings.lrs:
                for label, warm in SCHEDULES:
                    runs = [
                        r
                        for r in records
                        if r["run"] == "trained"
                        and (r["placement"], r["num_layers"], r["lr"], r["warmup"]) == (placement, num_layers, lr, warm)
                    ]
                    if runs:
                        yield placement, num_layers, lr, label, runs


def training_rows(records: list[dict], settings: SweepSettings) -> list[list]:
    return [
        [
            placement,
            num_layers,
            f"{lr:g}",
            label,
            f"{sum(r['diverged'] is not None for r in runs)}/{len(runs)}",
            mean_spread([max(r["losses"][1:], default=math.nan) for r in runs]),
            mean_spread([final_loss(r["losses"]) for r in runs]),
            mean_spread([r["eval_loss"] for r in runs]),
        ]
        for placement, num_layers, lr, label, runs in trained_cells(records, settings)
    ]


def depth_rows(records: list[dict], settings: SweepSettings, measurement: str) -> list[list]:
    rows = []
    for num_layers in settings.layers:
        for placement in settings.placements:
            inits = [
                r
                for r in records
                if r["run"] == "init" and (r["placement"], r["num_layers"]) == (placement, num_layers)
            ]
            if inits:
                rows.append([placement, num_layers, "init", "", len(inits), profile(inits, measurement)])
    for placement, num_layers, lr, label, runs in trained_cells(records, settings):
        rows.append([placement, num_layers, f"{lr:g}", label, len(runs), profile(runs, measurement)])
    return rows


def accelerator() -> str:
    return f" and a {torch.cuda.get_device_name()} (the Trainer trains there)" if torch.cuda.is_available() else ""


def render_sweep(records: list[dict], settings: SweepSettings, elapsed: float, corpus: str) -> str:
    planned = len(list(settings.grid())) * (1 + 2 * len(settings.lrs))
    done = "every run of the grid" if len(records) == planned else f"{len(records)} of the grid's {planned} records"
    header = ["placement", "layers", "lr", "schedule", "diverged", "peak train loss", "final train loss", "eval loss"]
    training = markdown_table(header, training_rows(records, settings))
    header = ["placement", "layers", "lr", "schedule", "runs", "first quarter / … / last quarter"]
    gradients = markdown_table(header, depth_rows(records, settings, "gradient_norms"))
    redundancy = markdown_table(header, depth_rows(records, settings, "angular_distance"))
    return f"""# Normalization placements of deep, narrow stacks on real text: a learning-rate and warm-up sweep

Written by `{settings.command}`: {done}, in {elapsed / 60:.1f} minutes of wall clock on one thread
(`torch.set_num_threads(1)`), on a machine with {os.cpu_count()} CPU cores{accelerator()}. Every number is in
`results.json`.

**Models**: `EncoderStackForMaskedLM`, hidden size {settings.hidden_size}, {settings.heads} heads, FFN
{4 * settings.hidden_size}, rotary positions, no dropout, weights drawn from normal(0, {settings.initializer_range:.4g})
(the placement's own gain on top: DeepNorm's beta). Each seed ({settings.seed} to {settings.seed + settings.seeds - 1})
draws one initialization per placement and depth, measured, then trained from there at every learning rate, with and
without warm-up, on the batches of that seed.

{corpus}

**Training**: {settings.steps} steps of `encoderstack pretrain`'s Trainer (AdamW, weight decay 0.01, scheduler
`constant`), no gradient clipping. *Warm-up*: the rate rises linearly over the first {settings.warmup_steps} steps;
*no warm-up*: the full rate from the first step. A run **diverged** when its loss becomes NaN/inf (it stops there) or
its final loss (mean of the last tenth of the steps) is above its first. Spreads are sample standard deviations over
the seeds (finite runs only).

## 1. Divergence and loss

The **peak** is the highest training loss after the first step: a spike shows there even when the run recovers.

{training}

## 2. Gradient norm over depth

The L2 norm of each layer's parameter gradients after one masked-LM backward pass on the measurement batch, averaged
over each quarter of the layers and over the runs (finite ones), at initialization and after training.

{gradients}

## 3. Layer redundancy over depth

The angular distance arccos(cos(h_(i-1), h_i)) / pi between the input and the output of layer i, mean over the real
tokens of the measurement batch, averaged per quarter of the layers: near 0, a layer that hardly changes its input
(the "curse of depth": deep layers that can be removed).

{redundancy}
"""

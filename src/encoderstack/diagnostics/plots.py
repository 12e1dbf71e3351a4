"""The report's figures: one grid per measurement, a column per depth, a line per placement.

matplotlib is an optional extra (`pip install 'encoderstack[diagnostics]'`); it is imported only here, and without
pyplot, so that drawing touches no global backend state.
"""

from collections.abc import Callable
from pathlib import Path

from ..configuration_encoderstack import PLACEMENT_REGISTRY

DPI = 80
COLORS = {name: entry.colour for name, entry in PLACEMENT_REGISTRY.items()}
Series = list[tuple[str, list[float], str]]  # (label suffix, values, line style)


def require_matplotlib():
    try:
        import matplotlib.figure
        import matplotlib.ticker
    except ImportError:
        raise ImportError("the diagnostics plots need matplotlib: pip install 'encoderstack[diagnostics]'") from None
    return matplotlib


def stream_series(curves: dict[str, list[float]]) -> Series:
    """The hidden stream as a solid line, ResiDual's `d` stream (when there is one) dashed."""
    series = [("", curves["hidden"], "-")]
    if "dual" in curves:
        series.append((" (d stream)", curves["dual"], "--"))
    return series


def plot_grid(
    path: Path,
    results: list[dict],
    rows: list[tuple[str, Callable[[dict], Series]]],
    xlabel: str,
    ylabel: str,
    first_x: int,
    log_scale: bool,
) -> None:
    """One row per (title, series of a result), one column per depth; x counts from `first_x`."""
    matplotlib = require_matplotlib()
    depths = sorted({result["num_layers"] for result in results})
    figure = matplotlib.figure.Figure(figsize=(3.4 * len(depths) + 1.6, 2.3 * len(rows) + 0.4), layout="constrained")
    axes = figure.subplots(len(rows), len(depths), squeeze=False)
    for (row_title, series_of), row_axes in zip(rows, axes):
        for depth, ax in zip(depths, row_axes):
            for result in (r for r in results if r["num_layers"] == depth):
                for suffix, values, style in series_of(result):
                    ax.plot(
                        range(first_x, first_x + len(values)),
                        values,
                        style,
                        color=COLORS[result["placement"]],
                        label=result["placement"] + suffix,
                        linewidth=1.2,
                    )
            ax.set_title(f"{depth} layers, {row_title}", fontsize=9)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.tick_params(which="both", labelsize=7)
            ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
            if log_scale:
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(matplotlib.ticker.LogFormatter())
                ax.yaxis.set_minor_formatter(matplotlib.ticker.LogFormatter(minor_thresholds=(1, 0.4)))
    figure.legend(*axes[0][0].get_legend_handles_labels(), loc="outside right upper", fontsize=8)
    figure.savefig(path, dpi=DPI)


SCHEDULES = (("at init", "init"), ("trained, warm-up", "warmup"), ("trained, no warm-up", "no_warmup"))


def single_series(values: list[float]) -> Series:
    return [("", values, "-")]


def per_schedule(measurement: str, schedules=SCHEDULES, as_series=stream_series) -> list[tuple[str, Callable]]:
    return [(title, lambda result, key=key: as_series(result[measurement][key])) for title, key in schedules]


def draw_gradient_norms(path: Path, results: list[dict]) -> None:
    rows = [("at init", lambda result: single_series(result["gradient_norms"]))]
    plot_grid(path, results, rows, "layer i", "grad norm of layer i", first_x=1, log_scale=True)


def draw_activation_rms(path: Path, results: list[dict]) -> None:
    plot_grid(
        path,
        results,
        per_schedule("activation_rms"),
        "layer i (0: embeddings)",
        "RMS after layer i",
        first_x=0,
        log_scale=True,
    )


def draw_layer_similarity(path: Path, results: list[dict]) -> None:
    plot_grid(
        path, results, per_schedule("similarity"), "layer i", "cos(layer i-1, layer i)", first_x=1, log_scale=False
    )


def draw_loss_curves(path: Path, results: list[dict]) -> None:
    plot_grid(
        path,
        results,
        per_schedule("losses", SCHEDULES[1:], single_series),
        "step",
        "training loss",
        first_x=1,
        log_scale=False,
    )


FIGURES = {
    "gradient_norms.png": draw_gradient_norms,
    "activation_rms.png": draw_activation_rms,
    "layer_similarity.png": draw_layer_similarity,
    "loss_curves.png": draw_loss_curves,
}


def write_figures(results: list[dict], folder: Path) -> None:
    for name, draw in FIGURES.items():
        draw(folder / name, results)

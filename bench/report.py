"""What every benchmark does with its results: a JSON record and a PNG plot under `bench/results/`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1))
    return path


def figure(ncols: int = 1, width: float = 7.0):
    """A figure with `ncols` axes (non-interactive backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, 4))
    return fig, axes


def grouped_bars(ax, labels: list[str], series: dict[str, list[float]], ylabel: str) -> None:
    """One bar per series in each group, side by side (series name -> one value per label)."""
    xs = range(len(labels))
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        ax.bar([x + (k - (len(series) - 1) / 2) * width for x in xs], values, width, label=name)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel(ylabel)
    ax.legend()


def paired_bars(ax, labels: list[str], first: list[float], second: list[float], names: tuple[str, str],
                ylabel: str) -> None:
    """Two bars per group (e.g. pdspark vs a peer)."""
    grouped_bars(ax, labels, {names[0]: first, names[1]: second}, ylabel)


def save_figure(fig, name: str, title: str) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.png"
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}", file=sys.stderr)
    return path

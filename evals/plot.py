"""Val loss and eval scores against training tokens seen, from a run's metrics.jsonl.

python -m evals.plot runs/x        # writes runs/x/evals.png
"""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path
from typing import Any

from modeling.disk import DiskFull, atomic_write_bytes, disk_full_reported
from modeling.runs import EVALS_PLOT, METRICS_FILE, RunError, read_metrics

_SCORES = ("hellaswag_acc_norm", "lambada_acc")


def plot_evals(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Val loss (left) and HellaSwag acc_norm / LAMBADA acc (right) vs tokens seen, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_path)
    # Only the train-metric rows carry tokens_seen; every step is the same number of tokens, so the eval rows'
    # steps convert with the ratio (runs without it are plotted against steps).
    scale = next((r["tokens_seen"] / r["step"] for r in reversed(rows) if r.get("tokens_seen") and r["step"]), None)
    fig, (loss_ax, score_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, keys, ylabel in ((loss_ax, ("val_loss",), "val loss (nats/token)"), (score_ax, _SCORES, "accuracy")):
        for key in keys:
            points = [(r["step"] * (scale or 1), r[key]) for r in rows if key in r and r.get("step") is not None]
            if points:
                ax.plot(*zip(*points), "o-", label=key.replace("_", " "))
        ax.set_xlabel("tokens seen" if scale else "optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    if any("hellaswag_acc_norm" in r for r in rows):
        score_ax.axhline(0.25, color="gray", linestyle="--", label="HellaSwag chance")
    for ax in (loss_ax, score_ax):
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.tight_layout()
    save_png(fig, out_png)
    return Path(out_png)


def save_png(fig: Any, out_png: str | Path) -> None:
    """A matplotlib figure to `out_png`, closed; written whole or not at all (a full disk keeps the last plot)."""
    atomic_write_bytes(Path(out_png), png_bytes(fig))


def png_bytes(fig: Any) -> bytes:
    """A matplotlib figure as PNG bytes, the figure closed."""
    import matplotlib.pyplot as plt

    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=120)
    plt.close(fig)
    return png.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Plot val loss and eval scores vs tokens seen for a run folder.")
    parser.add_argument("run", help="run folder with metrics.jsonl")
    args = parser.parse_args(argv)
    metrics = Path(args.run) / METRICS_FILE
    if not metrics.is_file():
        sys.exit(f"error: {metrics} does not exist; pass a run folder that training has logged to")
    png = Path(args.run) / EVALS_PLOT
    try:
        with disk_full_reported(png, f"{png.name} is as it was"):
            print(plot_evals(metrics, png))
    except (DiskFull, RunError) as err:  # RunError: a line of metrics.jsonl that is not a row
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()

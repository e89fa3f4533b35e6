"""Training curves as one PNG per stage run: what a reviewer looks at first in the MLflow UI.

Matplotlib (Agg backend, no display) is optional: where it is not installed (a bare GPU box)
no figure is made and training is unaffected.
"""

from __future__ import annotations

from typing import Any

# The curves worth a panel, in display order; a stage plots the ones it logged.
CURVES = ("train/loss", "eval/accuracy", "rollout/reward_mean", "train/kl", "train/reward_accuracy",
          "train/reward_margin", "train/entropy", "eval/reward_accuracy")


class RecordingSink:
    """A metric sink that forwards to another and keeps every ``(step, value)`` per name."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.history: dict[str, list[tuple[int, float]]] = {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.inner.log_metrics(metrics, step)
        for name, value in metrics.items():
            self.history.setdefault(name, []).append((step, float(value)))

    def __getattr__(self, name: str) -> Any:  # log_table, log_dict, ... reach the wrapped sink
        return getattr(self.inner, name)


def curves_figure(history: dict[str, list[tuple[int, float]]], title: str) -> Any | None:
    """A figure with one panel per logged curve of :data:`CURVES`, or None (nothing to plot, no matplotlib)."""
    names = [n for n in CURVES if len(history.get(n, ())) >= 1]
    if not names:
        return None
    try:
        import matplotlib  # lazy: matplotlib (optional: no figure without it)

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # lazy: matplotlib (optional: no figure without it)
    except ImportError:
        return None
    fig, axes = plt.subplots(1, len(names), figsize=(3.2 * len(names), 2.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        steps, values = zip(*history[name])
        ax.plot(steps, values, marker="o" if len(steps) < 3 else None)
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig

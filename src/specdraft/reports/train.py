"""The training run's curves rendered from its history records (``trainer_state.json``'s ``history``): loss and
simulated acceptance per evaluation, ``train_curves.png``."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt


def plot_history(history: list[dict], path: Path, k: int) -> None:
    matplotlib.use("Agg")
    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.plot([h["step"] for h in history if h["train_loss"] is not None],
             [h["train_loss"] for h in history if h["train_loss"] is not None], label="train")
    ax1.plot(steps, [h["heldout_loss"] for h in history], label="held-out")
    ax1.set_xlabel("step"), ax1.set_ylabel("loss"), ax1.legend(), ax1.set_title("loss")
    ax2.plot(steps, [h["sim_accept"] for h in history], marker="o")
    ax2.set_xlabel("step"), ax2.set_ylabel(f"mean accepted (of {k})"), ax2.set_title("simulated acceptance")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

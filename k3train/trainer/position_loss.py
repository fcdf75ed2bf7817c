"""Loss by position inside the window (``k3train eval --by-position``): does a model use its
context? A model that does predicts later tokens better than early ones, so its loss falls
with the position; one that does not stays flat after the first few tokens.

Positions are bucketed by powers of two (``[0, 1), [1, 2), [2, 4), [4, 8), ...`` up to the
window's length), as a log-x plot reads them: every doubling of the context gets one point.
"""
from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from k3train.errors import UsageError


def position_buckets(seq_len: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` half-open position ranges covering ``0 .. seq_len - 1``: ``[0, 1)``,
    then doublings, the last one cut at ``seq_len``."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    out, lo = [(0, 1)], 1
    while lo < seq_len:
        hi = min(2 * lo, seq_len)
        out.append((lo, hi))
        lo = hi
    return out


def token_losses(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """logits ``[B, T, V]``, targets ``[B, T]`` (-100: not scored) -> (losses ``[B, T]`` fp32,
    0 where not scored; scored ``[B, T]`` bool)."""
    losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100,
                             reduction="none").view(targets.shape)
    return losses, targets != -100


class PositionLoss:
    """Sums of the per-token loss and counts per position bucket, over the batches ``add`` gets."""

    def __init__(self, seq_len: int):
        self.buckets = position_buckets(seq_len)
        self.seq_len = seq_len
        self.sums = torch.zeros(len(self.buckets), dtype=torch.float64)
        self.counts = torch.zeros(len(self.buckets), dtype=torch.float64)

    def add(self, losses: torch.Tensor, scored: torch.Tensor) -> None:
        """losses, scored: ``[B, T]`` from ``token_losses``."""
        if losses.shape[1] != self.seq_len:
            raise ValueError(f"a batch of {losses.shape[1]} positions for buckets of {self.seq_len}")
        per_pos = (losses.double() * scored).sum(0).cpu()
        n_pos = scored.sum(0).double().cpu()
        for i, (lo, hi) in enumerate(self.buckets):
            self.sums[i] += per_pos[lo:hi].sum()
            self.counts[i] += n_pos[lo:hi].sum()

    def rows(self) -> list[dict]:
        """One dict per bucket: ``from``, ``to`` (positions, half-open), ``tokens``, ``loss``
        (mean over its scored tokens; None when it had none)."""
        return [{"from": lo, "to": hi, "tokens": int(n), "loss": float(s / n) if n else None}
                for (lo, hi), s, n in zip(self.buckets, self.sums.tolist(), self.counts.tolist())]


def format_rows(rows: list[dict]) -> str:
    """The table ``k3train eval --by-position`` prints."""
    lines = [f"{'positions':>17} {'tokens':>10} {'loss':>8}"]
    for r in rows:
        loss = "n/a" if r["loss"] is None else f"{r['loss']:.4f}"
        lines.append(f"{r['from']:>8} - {r['to'] - 1:<6} {r['tokens']:>10,} {loss:>8}")
    return "\n".join(lines)


def plot_rows(rows: list[dict], path: str | Path, title: str) -> Path:
    """Loss against position (log-x, each bucket at its geometric middle) as a PNG at ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [(((r["from"] + 1) * r["to"]) ** 0.5, r["loss"]) for r in rows if r["loss"] is not None]
    if not points:
        raise UsageError("no scored token in the evaluated batches: nothing to plot")
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([x for x, _ in points], [y for _, y in points], marker="o")
    ax.set_xscale("log")
    ax.set_xlabel("position in the window (tokens, log scale)")
    ax.set_ylabel("mean next-token loss (nats)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path

"""The LR schedule, owned by the toolkit and identical for every backend."""
from __future__ import annotations

import math

from toolkit.config import TrainConfig


def lr_at(step: int, t: TrainConfig) -> float:
    """LR for the optimizer step with 0-based index ``step``: linear warmup, then decay to min_lr."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.lr_schedule == "constant":
        return t.lr
    progress = min(1.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps))
    if t.lr_schedule == "linear":
        return t.lr + (t.min_lr - t.lr) * progress
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))

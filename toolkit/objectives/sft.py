"""Supervised fine-tuning (``train.objective: sft``): the mean token cross-entropy over the global batch's
valid tokens (the engine's ``Scores.loss_sum``: HF's chunked fp32 cross-entropy, megatron's vocabulary-parallel
one, DeepSpeed's tiled loss)."""
from __future__ import annotations

from typing import ClassVar

import torch

from toolkit.objectives.base import Objective


class SFT(Objective):
    name: ClassVar[str] = "sft"

    def __call__(self, scores, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(the token loss sum, ``[valid tokens]`` fp64)."""
        total, count = scores.loss_sum(mb["labels"])
        return total, count.double().view(1)

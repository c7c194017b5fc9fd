"""The Engine protocol: what the trainer loop needs from a backend (DeepSpeed or Megatron).

The trainer owns the data order, the LR schedule and the loss contract; an engine owns the model,
the optimizer and how gradients are reduced across data-parallel ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import torch

from toolkit.config import DTYPE_NAMES

DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()}
"""model.dtype -> the torch dtype engines train in."""


@dataclass
class StepStats:
    loss: float
    """Mean loss over the global batch (all micro-batches, all DP ranks): over its valid tokens, or what
    else the objective counts (preference pairs: ``toolkit/objectives/``)."""
    grad_norm: float | None
    """Global L2 norm of the gradient before clipping; None when the step was skipped."""
    compute_s: float = 0.0
    """This rank's own device time for its forwards in the step (CUDA events on a GPU), not
    waiting on peers: the straggler signal."""
    skipped: bool = False
    """fp16: the loss scaler found inf/nan gradients and skipped the update (the scale drops)."""
    loss_scale: float | None = None
    """fp16: the dynamic loss scale after the step."""
    extra: dict = field(default_factory=dict)
    """More per-step metrics for metrics.jsonl (mixture of experts: ``toolkit/adapters/moe.py``)."""


class Engine(Protocol):
    """What the loop, the checkpointer and the health monitor call; ``adapters/deepspeed/engine.py`` and
    ``adapters/megatron/engine.py`` implement it (``tests/unit/test_architecture.py`` checks the names
    and signatures match)."""
    dp_rank: int
    dp_size: int
    dp_group: object
    eval_metrics: dict
    """The objective's metrics of the last ``eval_loss_sum`` ({} for the token cross-entropy)."""
    """The process group of this rank's data-parallel replicas (None: the whole world)."""

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], loss_tokens: int, lr: float) -> StepStats:
        """One optimizer step over this rank's micro-batches of a global batch.

        ``loss_tokens`` is the objective's count of the whole global batch (all ranks: its valid tokens,
        or its preference pairs), so the gradient is that of ``sum(the objective's loss sums) / loss_tokens``
        whatever the DP size or accumulation (``toolkit/objectives/base.py``); ``StepStats.extra`` holds the
        objective's metrics of the global batch.
        """

    def eval_loss_sum(self, micro_batches: list[dict[str, torch.Tensor]], beat=None) -> tuple[float, int]:
        """The objective's summed loss and its count (valid tokens, or pairs) over the whole DP group (already
        reduced); ``eval_metrics`` then holds the objective's metrics of the eval rows, ``eval_`` prefixed.
        ``beat()``, if given, after each micro-batch: the heartbeat's progress (here and below)."""

    def document_logps(self, micro_batches: list[dict[str, torch.Tensor]], width: int,
                       beat=None) -> list[torch.Tensor] | None:
        """Forward only, the model as built (a LoRA run's base): ``[mbs, width]`` fp64 sums of each
        document's answer log-probabilities per micro-batch (``objectives.document_sums``), on the ranks
        that hold them (one per DP replica; the others: None). The reference scores of preference
        objectives (``toolkit/objectives/reference.py``); collective."""

    def save(self, path: Path, step: int, beat=None) -> None:
        """Write this engine's state (model, optimizer) of ``step`` under ``path``; collective;
        ``beat()`` after each file written (where the backend's writer lets us see them)."""

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote; collective."""

    def export_hf(self, path: Path, tokenizer, beat=None) -> None:
        """Write the current weights as an HF ``save_pretrained`` directory; collective; ``beat()``
        after each tensor."""

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This rank's model parameters (its shard under TP/PP; the full model below ZeRO-3)."""

    def rng_state(self) -> dict:
        """RNG streams the engine keeps beyond torch's default generators (megatron's model-parallel
        CUDA RNG tracker, which drives dropout), for the per-rank checkpoint; {} if none."""

    def set_rng_state(self, state: dict) -> None:
        """Restore what ``rng_state`` returned (a checkpoint without it: ``{}``, nothing to do)."""

    def layout_record(self) -> dict:
        """The parallel layout, recorded in checkpoint metadata (e.g. ``{"dp": 2, "zero_stage": 2}``)."""

    def can_load_layout(self, saved: dict) -> bool:
        """Whether ``load`` reshards a checkpoint written at ``saved`` (another layout record) itself;
        if not, the checkpointer converts it first."""

    def close(self) -> None:
        """Release what the engine holds beyond its memory (process groups, hooks that keep it alive);
        after the last use: the engine cannot step afterwards."""

    def replica_checksum(self) -> float | None:
        """A checksum of the parameters every DP replica must hold alike (None where each holds only
        a shard): the divergence check."""

"""The objective protocol and what objectives share: an engine hands an objective the scores of a micro-batch
(``Scores``: its logits as the backend holds them) and the micro-batch; the objective returns a loss sum and a
vector of fp64 sums for its metrics (calling the ``Objective``), in the shape of torchtitan's ``BaseLoss``.

The loss contract: an engine's backward starts from ``loss_sum / count`` where ``count`` is the objective's
``count`` of the whole global batch (``data.batch_counts``: valid tokens, or preference pairs), so the gradient
is that of the global batch's mean whatever the DP size, micro-batch size or packing. The last entry of the
stats vector counts this micro-batch's share of ``count``; engines sum ``[loss sum, stats]`` over micro-batches
and ranks, report ``loss sum / count`` and hand the summed stats back to ``Objective.metrics``.
"""
from __future__ import annotations

from typing import Callable, ClassVar, Protocol

import torch
import torch.nn.functional as F


class Scores(Protocol):
    """A micro-batch's scores as an engine holds them (HF logits ``[batch, seq, vocab]``, megatron's
    vocabulary-parallel logits, DeepSpeed's tiled hidden states); ``labels`` ``[batch, seq]`` already shifted,
    IGNORE_INDEX where no loss is taken."""

    def loss_sum(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the token cross-entropies, the number of valid tokens)."""

    def logps(self, labels: torch.Tensor) -> torch.Tensor:
        """``[batch, seq]`` fp32 log-probability of each label token (0 where IGNORE_INDEX), differentiable."""


class Prepared(Protocol):
    """What an objective's ``prepare`` hook made before the first step (the reference model's scores):
    columns it attaches to every micro-batch, and the key a checkpoint records (trainer.json ``reference``)."""
    key: str | None

    def attach(self, split: str, micro_batches: list[dict], indices: list[int],
               batch: list[int] | None = None) -> list[dict]:
        """``micro_batches`` (this rank's, of the rows ``indices`` of ``split``; ``batch``: every rank's rows
        of this global batch or eval) with the objective's columns."""

    def check_resumed(self, saved: str | None) -> None:
        """Refuse a checkpoint trained against another ``key`` (a ConfigError)."""


class Objective:
    """One training objective (one file of ``toolkit/objectives/`` each, found there by ``resolve``)."""
    name: ClassVar[str]
    """``train.objective``'s value."""
    stats_size: ClassVar[int] = 1
    """Length of the stats vector a call returns; its last entry counts what the loss is a mean over."""
    count: ClassVar[str] = "loss_tokens"
    """The ``data.batch_counts`` key of the global batch's count: the engine divides the loss sum by it."""
    logged_count: ClassVar[str | None] = None
    """Where the step record logs that count, if it is not already there."""
    eval_count: ClassVar[str] = "eval_tokens"
    """The eval record's name for it."""

    @classmethod
    def of(cls, cfg) -> "Objective":
        """The objective with the run's settings (``RunConfig``)."""
        return cls()

    def __call__(self, scores: Scores, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(this micro-batch's loss sum, differentiable; ``[stats_size]`` fp64 detached sums for ``metrics``)."""
        raise NotImplementedError

    def metrics(self, stats: torch.Tensor | list[float], prefix: str = "") -> dict[str, float]:
        """The metrics of ``stats`` summed over a global batch (or an eval); ``prefix``: ``eval_``."""
        return {}

    def prepare(self, cfg, engine, data, log: Callable[[str], None], phase: Callable) -> Prepared | None:
        """The hook before the first step and before a checkpoint loads (the engine still holds the starting
        model); collective. ``phase("load")`` beats the heartbeat and gives the callable to call after each
        unit of work. None: nothing to attach."""
        return None


def as_floats(stats: torch.Tensor | list[float]) -> list[float]:
    """Engines pass the values they read (one ``.tolist()`` with the loss); a device tensor is read once here."""
    return stats.tolist() if isinstance(stats, torch.Tensor) else [float(x) for x in stats]


class DocumentSums(torch.autograd.Function):
    """Per-document sums of ``values`` ``[batch, seq]``: ``[batch, width]`` fp64, column d-1 for document
    d (1..width; an absent document sums to 0). Each document is a contiguous run of tokens, so the
    forward takes the difference of an fp64 running sum at its ends (no atomics: deterministic on
    every device); the backward hands each token its document's gradient (a gather: exact)."""

    @staticmethod
    def forward(ctx, values: torch.Tensor, document_ids: torch.Tensor, width: int) -> torch.Tensor:
        b, s = values.shape
        pos = torch.arange(s, device=values.device).expand(b, s)
        ends = torch.full((b, width + 1), -1, dtype=torch.long, device=values.device).scatter_reduce(
            1, document_ids, pos, "amax")
        starts = torch.full((b, width + 1), s, dtype=torch.long, device=values.device).scatter_reduce(
            1, document_ids, pos, "amin")
        running = F.pad(values.double().cumsum(1), (1, 0))  # [b, s + 1]: running[:, i] = sum of values[:, :i]
        sums = running.gather(1, ends + 1) - running.gather(1, starts.clamp(max=s))
        ctx.save_for_backward(document_ids)
        ctx.dtype = values.dtype
        return torch.where(ends >= 0, sums, 0.0)[:, 1:]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (document_ids,) = ctx.saved_tensors
        per_document = F.pad(grad, (1, 0))  # padding (document 0) gets no gradient
        return per_document.gather(1, document_ids).to(ctx.dtype), None, None


def document_sums(values: torch.Tensor, document_ids: torch.Tensor, width: int) -> torch.Tensor:
    """``[batch, width]`` fp64 sums of ``values`` ``[batch, seq]`` per document 1..width (``DocumentSums``)."""
    return DocumentSums.apply(values, document_ids, width)


def pairs_present(document_ids: torch.Tensor, width: int) -> torch.Tensor:
    """``[batch, width / 2]`` bool: pair j of the row is there (its rejected document, 2j, has tokens)."""
    with torch.no_grad():
        return document_sums((document_ids > 0).double(), document_ids, width)[:, 1::2] > 0

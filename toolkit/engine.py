"""The Engine protocol: what the trainer loop needs from a backend (DeepSpeed or Megatron).

The trainer owns the data order, the LR schedule and the loss contract; an engine owns the model,
the optimizer and how gradients are reduced across data-parallel ranks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

import torch
import torch.nn.functional as F

from toolkit.config import DTYPE_NAMES
from toolkit.device import require_on_device

IGNORE_INDEX = -100
"""Labels with this value carry no loss (HF's and torch's convention)."""
DTYPES = {name: getattr(torch, torch_name) for name, torch_name in DTYPE_NAMES.items()}
"""model.dtype -> the torch dtype engines train in."""


@dataclass
class StepStats:
    loss: float
    """Mean loss over all valid tokens of the global batch (all micro-batches, all DP ranks)."""
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
    """What the loop, the checkpointer and the health monitor call; ``adapters/deepspeed.py`` and
    ``adapters/megatron/engine.py`` implement it (``tests/unit/test_architecture.py`` checks the names
    and signatures match)."""
    dp_rank: int
    dp_size: int
    dp_group: object
    """The process group of this rank's data-parallel replicas (None: the whole world)."""

    def train_step(self, micro_batches: list[dict[str, torch.Tensor]], loss_tokens: int, lr: float) -> StepStats:
        """One optimizer step over this rank's micro-batches of a global batch.

        ``loss_tokens`` is the number of valid tokens in the whole global batch (all ranks), so the
        gradient is that of ``sum(token losses) / loss_tokens`` whatever the DP size or accumulation.
        """

    def eval_loss_sum(self, micro_batches: list[dict[str, torch.Tensor]]) -> tuple[float, int]:
        """Summed token loss and valid-token count over the whole DP group (already reduced)."""

    def save(self, path: Path, step: int) -> None:
        """Write this engine's state (model, optimizer) of ``step`` under ``path``; collective."""

    def load(self, path: Path) -> None:
        """Restore what ``save`` wrote; collective."""

    def export_hf(self, path: Path, tokenizer) -> None:
        """Write the current weights as an HF ``save_pretrained`` directory; collective."""

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

    def replica_checksum(self) -> float | None:
        """A checksum of the parameters every DP replica must hold alike (None where each holds only
        a shard): the divergence check."""


LOSS_CHUNK_BYTES = 256 * 2**20
"""fp32 bytes of one chunk of logit rows in the loss: the most it upcasts at a time (its backward holds
about three such chunks at once: log-probabilities, their gradient, the logits' gradient in fp32)."""
LOSS_ROW_MULTIPLE = 8
"""Chunks start at multiples of 8 rows, so every row sits at the same 16-byte alignment it has in a
whole-tensor upcast: CUDA's softmax kernels pick their reduction order by pointer alignment."""


def loss_chunk_rows(vocab: int) -> int:
    """Rows of [rows, vocab] logits per loss chunk: fp32 within LOSS_CHUNK_BYTES, a multiple of 8."""
    rows = LOSS_CHUNK_BYTES // (4 * vocab) // LOSS_ROW_MULTIPLE * LOSS_ROW_MULTIPLE
    return max(LOSS_ROW_MULTIPLE, rows)


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor,
                   chunk_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token cross-entropies and the number of valid tokens.

    logits: [batch, seq, vocab] (any float dtype; the loss is computed in fp32), labels: [batch, seq]
    with IGNORE_INDEX where no loss is taken. Labels are already shifted by the data pipeline.
    The loss and the logits' gradient are bit for bit those of ``F.cross_entropy(logits.float(), ...,
    reduction="sum")``, but fp32 exists only ``chunk_rows`` rows at a time (``ChunkedCrossEntropy``).
    """
    require_on_device(labels, "labels")
    vocab = logits.shape[-1]
    loss = ChunkedCrossEntropy.apply(logits.reshape(-1, vocab), labels.reshape(-1),
                                     chunk_rows or loss_chunk_rows(vocab))
    return loss, (labels != IGNORE_INDEX).sum()


_SUM = 2  # at::Reduction::Sum, as aten's loss kernels take it


class ChunkedCrossEntropy(torch.autograd.Function):
    """Summed cross entropy of [N, V] logits against [N] targets, taken ``rows`` rows at a time.

    The whole-tensor form (``F.cross_entropy(logits.float(), target, reduction="sum")``) keeps an fp32
    [N, V] copy and autograd saves its fp32 log-softmax [N, V]: at a 151k vocabulary, 8 x 4096 tokens,
    20 GB each. Here only the logits (in their own dtype) are saved; each chunk is upcast and its
    log-softmax taken in the forward and again in the backward. Every kernel is the one autograd runs
    for the whole tensor, applied to whole rows (log_softmax, nll_loss_backward,
    _log_softmax_backward_data and the cast back), so each token's gradient is bit for bit the same.
    The loss too: the per-token losses are summed by the same nll_loss kernel over the same values in
    the same order (as an [N, 1] input whose only class is the picked log-probability)."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.rows = rows
        token_losses = torch.cat([F.nll_loss(F.log_softmax(x.float(), dim=-1), t, ignore_index=IGNORE_INDEX,
                                             reduction="none")
                                  for x, t in zip(logits.split(rows), target.split(rows))])
        valid = target != IGNORE_INDEX
        ctx.save_for_backward(logits, target, valid.sum().float())
        picked = (-token_losses).unsqueeze(1)  # [N, 1]: the log-probabilities the whole-tensor sum picks
        return F.nll_loss(picked, target.masked_fill(valid, 0), ignore_index=IGNORE_INDEX, reduction="sum")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        logits, target, total_weight = ctx.saved_tensors
        grad = torch.empty_like(logits)
        for x, t, g in zip(logits.split(ctx.rows), target.split(ctx.rows), grad.split(ctx.rows)):
            g.copy_(_chunk_grad(x, t, grad_loss, total_weight))  # the cast autograd's ToCopyBackward does
        return grad, None, None


def _chunk_grad(x: torch.Tensor, target: torch.Tensor, grad_loss: torch.Tensor,
                total_weight: torch.Tensor) -> torch.Tensor:
    """fp32 d(loss)/d(x) of one chunk of rows, by the kernels autograd runs for the whole tensor. A
    function of its own so that its temporaries die before the next chunk's are made (at most three
    chunks of fp32 live: log-probabilities, their gradient, the result)."""
    logp = F.log_softmax(x.float(), dim=-1)
    grad_logp = torch.ops.aten.nll_loss_backward(grad_loss, logp, target, None, _SUM, IGNORE_INDEX, total_weight)
    return torch.ops.aten._log_softmax_backward_data(grad_logp, logp, 1, torch.float32)

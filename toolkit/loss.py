"""The loss, one home for its facts: the ignore index, the token loss sum of the HF path (a chunked
cross-entropy whose fp32 exists only a chunk of rows at a time) and how large a chunk is.

Megatron's vocabulary-parallel loss (``adapters/megatron/engine.py``) needs megatron-core and stays
with its adapter; it takes its ignore index from here. The memory estimate (``estimate/``) sizes the
HF path's loss with ``loss_chunk_rows``; the data pipeline writes ``IGNORE_INDEX`` into its labels.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from toolkit.device import require_on_device

IGNORE_INDEX = -100
"""Labels with this value carry no loss (HF's and torch's convention)."""

LOSS_CHUNK_BYTES = 256 * 2**20
"""fp32 bytes of one chunk of logit rows in the loss: the most it upcasts at a time (its backward holds
about three such chunks at once: log-probabilities, their gradient, the logits' gradient in fp32)."""
LOSS_ROW_MULTIPLE = 8
"""Chunks start at multiples of 8 rows, so every row sits at the same 16-byte alignment it has in a
whole-tensor upcast: CUDA's softmax kernels pick their reduction order by pointer alignment."""


def mlp_tiles(seq: int, hidden: int) -> int:
    """``zero.tiled_mlp``'s tile count for rows of ``seq`` tokens (the tiled MLP and the memory
    estimate): ALST's rule: ceil(seq / hidden). No collective is needed to agree on it (ZeRO-3 gathers
    the MLP's parameters once per tile on every rank): every rank's rows are ``data.seq_len`` long
    (``seq_len / sp`` each under zero.sp), so every rank computes the same count, with no host sync
    per layer on a GPU."""
    return max(1, math.ceil(seq / hidden))


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


def token_logps(logits: torch.Tensor, labels: torch.Tensor, chunk_rows: int | None = None) -> torch.Tensor:
    """fp32 log-probability of each label token, 0 where the label is IGNORE_INDEX: ``[batch, seq]``.

    logits ``[batch, seq, vocab]`` (any float dtype), labels ``[batch, seq]`` already shifted. Bit for
    bit ``log_softmax(logits.float(), -1).gather(-1, labels)`` (masked) and its gradient, with fp32
    only ``chunk_rows`` rows at a time (``ChunkedTokenLogProbs``): the preference objectives
    (``toolkit/objectives/``) sum them per document."""
    require_on_device(labels, "labels")
    vocab = logits.shape[-1]
    out = ChunkedTokenLogProbs.apply(logits.reshape(-1, vocab), labels.reshape(-1),
                                     chunk_rows or loss_chunk_rows(vocab))
    return out.view(labels.shape)


class ChunkedTokenLogProbs(torch.autograd.Function):
    """Picked fp32 log-probabilities of [N, V] logits at [N] targets (0 at IGNORE_INDEX), ``rows`` rows at a
    time: only the logits are saved; the backward takes each chunk's log-softmax again and runs the
    kernels autograd runs for the whole-tensor gather (a scatter of the gradient into a zero [rows, V]
    and ``_log_softmax_backward_data``), so each token's gradient is bit for bit the same."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, rows: int) -> torch.Tensor:
        ctx.rows = rows
        valid = target != IGNORE_INDEX
        safe = target.masked_fill(~valid, 0).unsqueeze(1)
        ctx.save_for_backward(logits, safe, valid)
        picked = torch.cat([F.log_softmax(x.float(), dim=-1).gather(1, t)
                            for x, t in zip(logits.split(rows), safe.split(rows))]).squeeze(1)
        return picked * valid

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        logits, safe, valid = ctx.saved_tensors
        grad_picked = (grad_out * valid).unsqueeze(1)
        grad = torch.empty_like(logits)
        for x, t, gp, g in zip(logits.split(ctx.rows), safe.split(ctx.rows), grad_picked.split(ctx.rows),
                               grad.split(ctx.rows)):
            g.copy_(_chunk_logp_grad(x, t, gp))
        return grad, None, None


def _chunk_logp_grad(x: torch.Tensor, target: torch.Tensor, grad_picked: torch.Tensor) -> torch.Tensor:
    """fp32 d(picked log-probabilities)/d(x) of one chunk (a function of its own: its temporaries die
    before the next chunk's are made)."""
    logp = F.log_softmax(x.float(), dim=-1)
    grad_logp = torch.zeros_like(logp).scatter_(1, target, grad_picked)
    return torch.ops.aten._log_softmax_backward_data(grad_logp, logp, 1, torch.float32)


def tiled_token_loss_sum(hidden: torch.Tensor, head: torch.nn.Module, labels: torch.Tensor,
                         rows: int | None = None, tied: tuple = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """``token_loss_sum`` of ``head(hidden)`` without the [tokens, vocab] logits ever existing whole.

    hidden: the decoder's last hidden states ``[batch, seq, hidden]``, head: the lm_head (an
    ``nn.Linear``, called as a module so ZeRO-3 gathers its weight), labels ``[batch, seq]`` shifted.
    ``rows`` tokens at a time (default ``loss_chunk_rows``: the same fp32 bound as the chunked loss);
    the backward recomputes each tile's logits (``TiledLogitsLoss``). ``tied``: head weights that also
    feed an earlier part of the model (tied input embeddings), whose ZeRO-3 reduction waits for it."""
    require_on_device(labels, "labels")
    rows = rows or loss_chunk_rows(head.out_features)
    params = [p for p in head.parameters() if p.requires_grad]
    partitioned = any(hasattr(p, "ds_tensor") for p in params)  # ZeRO-3: whole only inside the head's call
    loss = TiledLogitsLoss.apply(hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1), head, rows,
                                 [(p, any(p is t for t in tied)) for p in params] if partitioned else [],
                                 *([] if partitioned else params))
    return loss, (labels != IGNORE_INDEX).sum()


class TiledLogitsLoss(torch.autograd.Function):
    """Summed cross entropy of ``head(hidden)`` [N, V] against [N] targets, ``rows`` tokens at a time.

    Only the hidden states are saved. The forward takes each tile's logits (no grad) and its token
    losses as ``ChunkedCrossEntropy`` does; the backward recomputes a tile's logits with grad, hands
    them the gradient ``_chunk_grad`` gives (the whole-tensor kernels) and runs autograd through the
    head for that tile alone, writing the hidden states' gradient tile by tile.

    The head's weight gradient is summed over the tiles in fp32 (``TileGrads``). Whole weights (no
    ZeRO, ZeRO 1-2) are inputs of this function: the sum is returned, so autograd accumulates it
    once, with whatever else the weight feeds (tied embeddings), and DeepSpeed's hooks reduce it once.
    ZeRO-3's weights are whole only inside the head's call: the last tile's backward accumulates the
    sum into them; a weight tied to the input embeddings has ``ds_grad_is_ready`` held back past the
    last tile (as DeepSpeed's own tiled functions do), its reduction then comes with the embedding's
    gradient."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, target: torch.Tensor, head: torch.nn.Module, rows: int,
                partitioned: list, *params: torch.Tensor) -> torch.Tensor:
        ctx.head, ctx.rows, ctx.partitioned = head, rows, partitioned
        with torch.no_grad():
            token_losses = torch.cat([F.nll_loss(F.log_softmax(head(h).float(), dim=-1), t,
                                                 ignore_index=IGNORE_INDEX, reduction="none")
                                      for h, t in zip(hidden.split(rows), target.split(rows))])
        valid = target != IGNORE_INDEX
        ctx.save_for_backward(hidden, target, valid.sum().float(), *params)
        picked = (-token_losses).unsqueeze(1)
        return F.nll_loss(picked, target.masked_fill(valid, 0), ignore_index=IGNORE_INDEX, reduction="sum")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        hidden, target, total_weight, *params = ctx.saved_tensors
        grad_hidden = torch.empty_like(hidden)
        sums = TileGrads(params or [p for p, _ in ctx.partitioned], partitioned=not params)
        tiles = list(zip(hidden.split(ctx.rows), target.split(ctx.rows), grad_hidden.split(ctx.rows)))
        for i, (h, t, g) in enumerate(tiles):
            last = i == len(tiles) - 1
            for p, tied in ctx.partitioned:
                p.ds_grad_is_ready = last and not tied
            h = h.detach().requires_grad_(True)
            with torch.enable_grad():
                logits = ctx.head(h)
                grad_logits = _chunk_grad(logits.detach(), t, grad_loss, total_weight).to(logits.dtype)
                g.copy_(sums.tile(logits, grad_logits, h, last))
            # free this tile's logits and their gradient before the next tile makes its own (kept alive
            # by the names until reassigned, they added two tiles of logits to the peak: measured)
            del logits, grad_logits
        for p, _ in ctx.partitioned:  # a tied weight's reduction comes with its other use's gradient
            p.ds_grad_is_ready = True
        return grad_hidden, None, None, None, None, *sums.result()


class TileGrads:
    """The weight gradients of a computation run a tile at a time (``TiledLogitsLoss``, the tiled MLP
    of ``adapters/deepspeed/tiles.py``), summed over the tiles in fp32. A bf16 running sum rounds at every tile:
    at 64 loss tiles the lm_head's gradient was 1.2e-2 from fp32 against 2.4e-3 untiled.

    Each tile's gradients come from ``torch.autograd.grad`` (nothing accumulates into ``.grad``) and
    are added to the fp32 sums. ``partitioned=False`` (whole weights, inputs of the caller's autograd
    Function): ``result()`` is the sums in the weights' dtypes, for the Function to return.
    ``partitioned=True`` (ZeRO-3, whose weights are whole only inside their module's call): the last
    tile runs ``torch.autograd.backward``, and a hook on each weight replaces that tile's gradient by
    the whole sum before it accumulates, so DeepSpeed's reduction hooks see one gradient per step."""

    def __init__(self, params: list[torch.Tensor], partitioned: bool):
        self.params, self.partitioned = list(params), partitioned
        self.sums: list[torch.Tensor | None] = [None] * len(self.params)

    def tile(self, out: torch.Tensor, grad_out: torch.Tensor, x: torch.Tensor, last: bool) -> torch.Tensor:
        """Backward of one tile (``out`` computed from the leaf ``x``); returns ``x``'s gradient."""
        if last and self.partitioned:
            hooks = [p.register_hook(self._whole_sum(i)) for i, p in enumerate(self.params)]
            try:
                torch.autograd.backward(out, grad_out)
            finally:
                for h in hooks:
                    h.remove()
            return x.grad
        grads = torch.autograd.grad(out, [x, *self.params], grad_out, allow_unused=True)
        for i, g in enumerate(grads[1:]):
            self._add(i, g)
        return grads[0]

    def _add(self, i: int, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self.sums[i] = grad.float() if self.sums[i] is None else self.sums[i].add_(grad)

    def _whole_sum(self, i: int):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            self._add(i, grad)
            return self.sums[i].to(grad.dtype)
        return hook

    def result(self) -> list[torch.Tensor | None]:
        """The summed gradients of whole weights, in their dtypes (None: no partitioned weight's)."""
        if self.partitioned:
            return []
        return [None if s is None else s.to(p.dtype) for s, p in zip(self.sums, self.params)]


class LogitScores:
    """A micro-batch's full-vocabulary logits ``[batch, seq, vocab]`` (the HF path) as the objectives read
    them (``objectives.base.Scores``): the chunked fp32 loss sum, or each label token's log-probability."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits

    def loss_sum(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return token_loss_sum(self.logits, labels)

    def logps(self, labels: torch.Tensor) -> torch.Tensor:
        return token_logps(self.logits, labels)

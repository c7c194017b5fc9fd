"""Queries' and keys' RMSNorm over all heads' width at once (``LayerSpec.qk_norm = "full"``, OLMo 2).

HF normalizes ``q_proj(x)`` ``[b, s, heads * d]`` (and ``k_proj(x)`` ``[b, s, kv_heads * d]``) before
splitting it into heads; megatron's ``q_layernorm``/``k_layernorm`` submodules see the split
``[s, b, heads_local, d]`` of this TP rank's heads and are built per head (``hidden_size = d``).
``FullWidthRMSNorm`` takes that submodule's place and normalizes the row of every head together:
under TP each rank holds only its heads, so the mean of squares is the global sum over the TP group
(an all-reduce of each rank's partial sums, whose backward is the all-reduce of the gradients: every
rank's output depends on every rank's input) over the full width. Its weight is this rank's heads'
slice of HF's ``[heads * d]`` weight (TP-split on dim 0, marked so for the grad norm and checkpoints).
Under sequence parallelism the attention's q and k already hold the whole sequence, so nothing more.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit.adapters.megatron import grid

HEADS = {"q": "num_attention_heads", "k": "num_query_groups"}
"""Which TransformerConfig field counts the heads a full-width norm spans."""


class _SumOverTP(torch.autograd.Function):
    """All-reduce (sum) over the TP group whose backward all-reduces the gradient too
    (megatron's ``reduce_from_tensor_model_parallel_region`` passes the gradient through unchanged,
    which is right only when the sum feeds one replicated output)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class FullWidthRMSNorm(torch.nn.Module):
    """RMSNorm of ``[s, b, heads_local, d]`` over all ``heads * d`` channels (across TP ranks), as HF's
    ``Olmo2RMSNorm`` of ``[b, s, heads * d]``: fp32, times the weight in fp32, cast back. Built by
    megatron's ``SelfAttention`` with ``hidden_size = d``; ``heads`` ("q" or "k") and ``tp`` (the run's
    layout's) from the spec."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, heads: str = "q", *, tp: int, **_unused):
        super().__init__()
        total = getattr(config, HEADS[heads])
        if total % tp:
            raise ValueError(f"a full-width {heads} norm over {total} heads cannot split over tp={tp}; "
                             f"choose tp dividing {total}")
        self.full_width, self.eps, self.tp = total * hidden_size, eps, tp
        self.weight = torch.nn.Parameter(torch.ones(self.full_width // tp))
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(*x.shape[:-2], -1).float()
        squares = rows.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            squares = _SumOverTP.apply(squares, grid.tp_group())
        rows = rows * torch.rsqrt(squares / self.full_width + self.eps)
        return (self.weight.float() * rows).to(x.dtype).reshape(x.shape)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The weight as one global ``[heads * d]`` tensor split over TP on dim 0 (what the
        converter writes), not a replicated one."""
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, {"weight": 0},
                                                   sharded_offsets)

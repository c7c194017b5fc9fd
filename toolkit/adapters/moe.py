"""Mixture of experts: the router load-balancing loss both backends share, and its metrics.

For one MoE layer over the T tokens of a micro-batch, with router logits ``z [T, E]`` and top-k routing:

    f_e = (tokens routed to expert e, counting each of a token's k choices) / T      (sum_e f_e = k)
    P_e = mean over the tokens of softmax(z)_e
    aux = E * sum_e f_e * P_e                                   (= k when the load is perfectly even)

which is HF's ``load_balancing_loss_func`` applied to that layer alone (the Switch Transformer loss
times k). The objective of a step is

    loss + coeff * (mean over MoE layers and over the global batch's micro-batches of aux)

with ``loss`` the LM loss of the loss contract (``toolkit/engine.py``) and ``coeff`` =
``train.moe_aux_loss_coeff`` (default: the HF config's ``router_aux_loss_coef``). HF itself pools all
layers' router logits into one such term; for one layer, or layers that route alike, the two agree.
Like any batch statistic, aux depends on the micro-batch size (it is a mean over a micro-batch), so
two runs compare at the same micro-batch size; DP size and accumulation do not change it.

The DeepSpeed path computes it from HF's ``router_logits`` (``adapters/deepspeed/moe.py``, with ``zero.sp`` too);
the megatron path from its router's logits (``adapters/megatron.py``, ``LoadBalancedRouter``). Pure torch:
no backend import here.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from toolkit.device import rank_device


def is_router_model(hf_config) -> bool:
    """An HF mixture-of-experts config (transformers' MoE models all carry ``output_router_logits``)."""
    return getattr(hf_config, "output_router_logits", None) is not None


def aux_loss_coeff(configured: float | None, hf_config) -> float:
    """``train.moe_aux_loss_coeff``, else the HF config's ``router_aux_loss_coef`` (0 for dense models)."""
    if not is_router_model(hf_config):
        return 0.0
    if configured is not None:
        return float(configured)
    return float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)


def routed_counts(logits: torch.Tensor, top_k: int, real: torch.Tensor | None = None) -> torch.Tensor:
    """Tokens per expert ``[E]`` (int64) under top-k routing of ``logits [T, E]``, counting only the
    ``real`` rows (``[T]`` bool; None: all). A scatter-add on the device: ``bincount`` and boolean
    indexing would each wait for the device to size their output."""
    chosen = torch.topk(logits, top_k, dim=-1).indices.reshape(-1)
    weight = torch.ones_like(chosen) if real is None else real.to(chosen.dtype).unsqueeze(-1).expand(-1, top_k).reshape(-1)
    return torch.zeros(logits.shape[-1], dtype=chosen.dtype, device=logits.device).scatter_add_(0, chosen, weight)


def load_balancing_loss(logits: torch.Tensor, counts: torch.Tensor, tokens: int | torch.Tensor,
                        real: torch.Tensor | None = None) -> torch.Tensor:
    """``E * sum_e (counts_e / tokens) * (sum over these rows of softmax(logits)_e / tokens)``.

    ``logits [t, E]`` may be a share of the ``tokens`` rows (sequence parallel: this rank's rows, with
    ``counts`` summed over all of them); the shares' losses then add up to the layer's loss. ``real``
    ``[t]`` bool: the rows that count (the others, padding, add nothing); ``tokens`` then counts
    only real rows, and may be a device tensor (no host sync)."""
    experts = logits.shape[-1]
    probs = torch.softmax(logits.float(), dim=-1)
    if real is not None:
        probs = probs * real.unsqueeze(-1)
    prob_sum = probs.sum(dim=0)
    return experts * torch.sum(counts.to(prob_sum.dtype) / tokens * prob_sum / tokens)


class AttachLoss(torch.autograd.Function):
    """Returns ``activation`` unchanged; in backward, adds the gradient of ``loss`` (weight 1), so
    a loss computed inside a layer joins the backward pass of the main loss."""

    @staticmethod
    def forward(ctx, activation: torch.Tensor, loss: torch.Tensor):
        ctx.save_for_backward(loss)
        return activation

    @staticmethod
    def backward(ctx, grad_output):
        (loss,) = ctx.saved_tensors
        return grad_output, torch.ones_like(loss)


@dataclass
class RouterStats:
    """Per step and MoE layer: tokens per expert and the summed aux loss over micro-batches, kept
    where the router runs (no host sync inside the forward) until ``metrics``.

    ``layers`` is the number of rows the backend indexes: megatron by global layer number (its MoE
    families make every layer MoE), the DeepSpeed path by position among the MoE layers."""
    layers: int
    experts: int
    counts: torch.Tensor | None = field(init=False, default=None)
    aux_sum: torch.Tensor | None = field(init=False, default=None)

    def add(self, layer: int, counts: torch.Tensor | None, aux: torch.Tensor) -> None:
        """``counts`` None on ranks that must not count them twice (TP peers)."""
        if self.counts is None:
            self.counts = torch.zeros(self.layers, self.experts, dtype=torch.float64, device=aux.device)
            self.aux_sum = torch.zeros(self.layers, dtype=torch.float64, device=aux.device)
        if counts is not None:
            self.counts[layer] += counts.detach().to(torch.float64)
        self.aux_sum[layer] += aux.detach().to(torch.float64)

    def metrics(self, micro_batches: int, group=None) -> dict:
        """Summed over ``group`` (every rank of the step), then: the mean aux over layers and the
        ``micro_batches`` of the global batch, tokens per expert per layer, and the load of the
        busiest expert relative to an even load (1.0 = balanced). Collective when distributed;
        a rank whose routers did not run (a pipeline stage without MoE layers) sends zeros."""
        both = torch.zeros(self.layers * (self.experts + 1), dtype=torch.float64,
                           device=self.counts.device if self.counts is not None else rank_device())
        if self.counts is not None:
            both = torch.cat([self.counts.reshape(-1), self.aux_sum])
        if dist.is_initialized():
            dist.all_reduce(both, group=group)
        both = both.cpu()
        counts = both[:-self.layers].reshape(self.layers, self.experts)
        aux = both[-self.layers:]
        self.counts = self.aux_sum = None
        even = counts.sum(dim=1, keepdim=True) / self.experts
        load = (counts / even.clamp(min=1)).amax().item() if counts.sum() else 0.0
        layers = max(int((counts.sum(dim=1) > 0).sum()), 1)  # rows that routed tokens: the MoE layers
        return {"moe_aux_loss": aux.sum().item() / (layers * micro_batches),
                "moe_load_max": round(load, 4),
                "moe_expert_tokens": [[int(c) for c in row] for row in counts]}


"""Mixture of experts on the DeepSpeed path: the load-balancing loss of ``toolkit/adapters/moe.py`` from
HF's ``router_logits``, with or without Ulysses sequence parallelism (``zero.sp``), and the ZeRO-3
leaf modules of the experts.

Under ``zero.sp`` each rank routes its slice of every row, but the loss of a layer is over a whole
micro-batch's tokens (``f_e`` and ``P_e`` are fractions of all of them). Each rank therefore sums its
tokens per expert and its real-token count over the sequence group (one all-reduce per micro-batch,
all layers at once, on the device), and computes the loss on its own rows with those whole counts:
``moe.load_balancing_loss`` of a share, and the shares over the group add up to the layer's loss
and its gradient (``P_e`` is linear in the rows' probabilities; the counts are detached). DeepSpeed
sums gradients over the world and divides by dp, as for the token loss (``adapters/deepspeed/ulysses.py``).
The statistics keep this rank's own counts and its share of aux, so ``RouterStats.metrics``' sum
over the world counts each token once and reports the whole aux.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from toolkit.adapters import moe
from toolkit.config import ConfigError, RunConfig


class RouterLoss:
    """The load-balancing loss from HF's ``router_logits`` (one ``[T, E]`` tensor per MoE layer), and
    its statistics; ``group``: the sequence-parallel group whose ranks split each row (None: whole
    rows on this rank)."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, group=None):
        config = model.config
        self.coeff = moe.aux_loss_coeff(cfg.train.moe_aux_loss_coeff, config)
        self.top_k = getattr(config, "num_experts_per_tok", None)
        if not self.top_k:
            raise ConfigError(f"{config.model_type}: an HF mixture-of-experts config without num_experts_per_tok; "
                              "the load-balancing loss needs the router's top-k (set it in config.json)")
        self.group = group
        self.shares = 1 if group is None else dist.get_world_size(group)
        self.stats: moe.RouterStats | None = None

    def loss(self, router_logits, real: torch.Tensor | None = None) -> torch.Tensor | float:
        """``coeff`` x the mean over MoE layers of this micro-batch's aux loss (this rank's share of it
        under sequence parallelism; recorded in ``stats``); ``router_logits``: one ``[tokens, E]`` (or
        ``[batch, seq, E]``) tensor per MoE layer, this rank's tokens; ``real`` ``[tokens]`` bool: the
        tokens that count (padding of rows packed by documents does not)."""
        if not router_logits:
            return 0.0  # a model without MoE layers in this configuration
        experts = router_logits[0].shape[-1]
        if self.stats is None:
            self.stats = moe.RouterStats(len(router_logits), experts)
        flat = [z.reshape(-1, experts) for z in router_logits]
        # masks, not indexing: no host sync
        own = torch.stack([moe.routed_counts(z.detach(), int(self.top_k), real) for z in flat])
        counts, tokens = self._whole_rows(own, flat[0].shape[0], real)
        total = 0.0
        for layer, logits in enumerate(flat):
            aux = moe.load_balancing_loss(logits, counts[layer], tokens, real)
            self.stats.add(layer, own[layer], aux)
            total = total + aux
        return self.coeff * total / len(router_logits)

    def _whole_rows(self, own: torch.Tensor, rows: int, real: torch.Tensor | None):
        """Tokens per expert ``[layers, E]`` and the token count of the whole rows: this rank's, or
        summed over the sequence group in one all-reduce (the count a device tensor when ``real``
        masks padding, so the host never waits)."""
        if real is None and self.group is None:
            return own, rows
        both = own.flatten().clone() if real is None else torch.cat([own.flatten(), real.sum().reshape(1).to(own.dtype)])
        if self.group is not None:
            dist.all_reduce(both, group=self.group)
        counts = both[:own.numel()].view_as(own)
        return counts, (both[-1].clamp(min=1) if real is not None else rows * self.shares)


def experts_as_leaf_modules(model: torch.nn.Module) -> None:
    """ZeRO-3 gathers a module's parameters in its forward hook. Where experts are modules of
    their own (transformers 4, custom MoE code), an expert that receives no tokens on one rank is
    not called there, and the ranks' gathers no longer match (a hang). Every module holding an
    ``experts`` child (transformers' sparse MoE blocks) becomes a ZeRO-3 leaf: its parameters are
    gathered all at once when the block runs (transformers 5 packs the experts into one module,
    which is always called; one gather per block is then still fewer collectives). The same holds
    under ``zero.sp``, where the ranks of a row's group route different tokens."""
    from deepspeed.utils import set_z3_leaf_modules
    blocks = sorted({type(m) for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)},
                    key=lambda c: c.__name__)
    if blocks:
        set_z3_leaf_modules(model, blocks)

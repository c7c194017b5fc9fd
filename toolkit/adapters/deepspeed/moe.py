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

import contextlib

import torch
import torch.distributed as dist

from toolkit.adapters import moe
from toolkit.config import ConfigError, RunConfig
from toolkit.formats.zero_autoep import AUTOEP_EXPERTS, hf_name


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


# --- expert parallelism: DeepSpeed's AutoEP (zero.ep > 1) -----------------------------------------------

def prepare_autoep() -> None:
    """Before ``deepspeed.initialize`` of a ``zero.ep > 1`` run: transformers 5's output-capture registry as
    AutoEP 0.19.8 uses it (``compat/transformers_autoep.py``)."""
    from toolkit.compat import transformers_autoep
    transformers_autoep.install()


def autoep_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The MoE blocks AutoEP put in place of HF's."""
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    return [m for m in module.modules() if isinstance(m, AutoEPMoELayer)]


def check_autoep_replaced(module: torch.nn.Module, moe_layers: int, ep: int, grouped: bool = True) -> dict:
    """Every MoE layer of the model must now be AutoEP's: a pattern that matched nothing leaves HF's
    blocks, each rank computing every expert, and the run would train as if zero.ep=1 at ep times the
    expert memory. The setup record of ``metrics.jsonl`` (ep, experts per rank, how AutoEP runs its
    experts: ``grouped``, the DeepSpeed JSON's ``use_grouped_mm``)."""
    layers = autoep_layers(module)
    if len(layers) != moe_layers:
        raise RuntimeError(f"zero.ep={ep}: DeepSpeed's AutoEP replaced {len(layers)} of this model's {moe_layers} "
                           f"MoE layers (its moe_layer_pattern did not match every layer's module name); the "
                           "toolkit's pattern is toolkit/plan/presets.py's AUTOEP_LAYERS")
    first = layers[0]
    return {"event": "moe", "expert_parallel": "deepspeed_autoep", "ep": ep, "experts": first.num_experts,
            "experts_per_rank": first.num_local_experts, "moe_layers": len(layers),
            "experts_implementation": "grouped_mm" if grouped else "eager"}


def differs_across_ep_group(param: torch.nn.Parameter) -> bool:
    """An AutoEP expert parameter: each rank of an EP group holds other experts (DeepSpeed marks them
    ``allreduce=False``; they are reduced over the expert-data-parallel group only)."""
    return getattr(param, "allreduce", True) is False


def autoep_source(module: torch.nn.Module, gather=None):
    """``hf_final/``'s source for a ``zero.ep`` run: ``adapters/export.py``'s ``ModuleSource`` over an AutoEP
    model under transformers' names (``formats/zero_autoep.py``'s table), each MoE layer's experts
    all-gathered over its EP group, one fused
    tensor at a time, every rank in the same order (the reads are collective). ``gather``: ZeRO-3's
    context making a parameter whole over its data-parallel group (an expert's: the expert-data-parallel
    group)."""
    from toolkit.adapters.export import ModuleSource

    class Source(ModuleSource):
        def __init__(self):
            self.layers = {name: layer for name, layer in module.named_modules()
                           if type(layer).__name__ == "AutoEPMoELayer"}
            self.experts: dict[str, tuple] = {}
            super().__init__(module, module.config.model_type, gather=gather)
            self.collective = True  # the experts' all-gathers take every rank of each EP group

        def _hf_params(self, module):
            out = {}
            for name, param in module.named_parameters():  # a tied embedding, the router's alias: once
                block = name.rpartition(".experts.")[0]
                if block in self.layers:
                    self._add_experts(out, block)
                else:
                    out[hf_name(name, set(self.layers))] = param
            return out

        def _add_experts(self, out: dict, block: str) -> None:
            if f"{block}.experts.down_proj" in out:
                return
            experts, layer = self.layers[block].experts, self.layers[block]
            for fused, parts in AUTOEP_EXPERTS.items():
                params = [getattr(experts, p) for p in parts]
                local = [tuple(getattr(p, "ds_shape", p.shape)) for p in params]
                shape = (layer.num_experts, sum(s[1] for s in local), *local[0][2:])
                out[f"{block}.experts.{fused}"] = torch.empty(shape, device="meta")
                self.experts[f"{block}.experts.{fused}"] = (layer, params)

        def _gathered_fp32(self, param_name: str):
            if param_name not in self.experts:
                return super()._gathered_fp32(param_name)
            layer, params = self.experts[param_name]
            parts = []
            for param in params:
                with self.gather(param) if self.gather else contextlib.nullcontext():
                    local = param.detach().float().contiguous()
                    pieces = [torch.empty_like(local) for _ in range(layer.ep_size)]
                    dist.all_gather(pieces, local, group=layer.ep_group)
                parts.append(torch.cat(pieces).cpu())
            return torch.cat(parts, dim=1) if dist.get_rank() == 0 else None

    return Source()

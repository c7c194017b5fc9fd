"""LoRA on megatron's column- and row-parallel linears with peft's function: one adapter per HF
projection (q, k and v apart although megatron fuses them into ``linear_qkv``; gate and up apart
in ``linear_fc1``), so a megatron LoRA run computes what ``peft`` computes on the HF model, and its
adapters are peft's tensors, split over TP.

Which linear carries which projections comes from the family's weight table, and how an adapter
splits over TP, from ``lora/geometry.py`` (``megatron_sites``, ``Geometry``); this module is the
part that runs megatron-core. Per projection, ``y += scaling x B @ A @ dropout(x)`` (peft's order,
one dropout mask per projection as peft draws them), with ``A [r, in]`` and ``B [out, r]`` split
over TP as the base is:

  column-parallel base (``linear_qkv``, ``linear_fc1``): A whole on every TP rank; B split by rows
      as the base's output is: each projection's own rows of this rank (for QKV: the rows of the
      rank's KV groups, a contiguous block of q's, k's and v's B; for the GLU: gate_r and up_r),
      placed into the fused output as megatron lays it out (per KV group [q, k, v]; [gate_r; up_r]).
      The r-wide ``h = A x`` goes through ``copy_to_tensor_model_parallel_region`` (backward: the
      TP all-reduce of dh, so A's gradient is whole and equal on every rank). Under sequence
      parallelism x is this rank's slice of the sequence; ``h`` is all-gathered along it (backward:
      reduce-scatter), so A's gradient is a partial sum over the sequence: A is marked
      ``sequence_parallel`` and megatron's ``finalize_model_grads`` sums it over TP.
  row-parallel base (``linear_proj``, ``linear_fc2``): A split by columns as the base's input is;
      B whole. ``h = A_r x_r`` is summed over TP (``reduce_from_tensor_model_parallel_region``;
      under sequence parallelism reduce-scattered along the sequence, B then marked
      ``sequence_parallel``), then ``B h`` is added to the base's reduced output.

Only r-wide activations cross ranks. A packed HF projection (GPT-2's ``c_attn`` = [q; k; v])
keeps its B as row blocks ("parts"), each split over TP like the projection it feeds.

Parameters live in the model tree as ``<linear>.lora.adapters.<projection>.A`` and
``.B.<part>`` (so megatron's DDP and distributed optimizer see them); the base is frozen. The
adapters are drawn as the DeepSpeed path draws them (``lora/peft.py``'s ``draw_adapters``: peft's
own init from a CPU generator seeded with (train.seed, "lora")) in HF shapes, on peft's skeleton
with no weights, and each rank keeps its slices: a megatron run starts from the DeepSpeed run's
adapters.

Names: ``lora/peft.py``'s ``peft_names(module)`` gives each adapter's HF-PEFT names (``base_model.model.<module>.lora_A.
default.weight``), the canonical names of exports, checkpoints and conversions.
"""
from __future__ import annotations

import torch

from toolkit.adapters.megatron import grid
from toolkit.layout import Layout
from toolkit.lora.geometry import (
    QKV,
    ROW_LINEAR,
    Geometry,
    Site,
    megatron_saved,
    megatron_sites,
    shard_adapter,
    unshard_adapter,
)
from toolkit.lora.peft import peft_names
from toolkit.lora.spec import LoraSpec

LORA_CHILD = "lora"
"""The child module of an adapted megatron linear that holds its adapters."""


def is_adapter_name(name: str) -> bool:
    """A megatron parameter name (local or global) of an adapter matrix."""
    return f".{LORA_CHILD}.adapters." in name


def short_name(module: str) -> str:
    return module.rsplit(".", 1)[-1]


# --- the adapted linear ------------------------------------------------------------------------------

class ProjectionAdapter(torch.nn.Module):
    """One HF projection's adapter on this rank: ``A`` and the ``B`` parts (shapes above)."""

    def __init__(self, a: torch.Tensor, b_parts: list[torch.Tensor]):
        super().__init__()
        self.A = torch.nn.Parameter(a)
        self.B = torch.nn.ParameterList([torch.nn.Parameter(b) for b in b_parts])


class LoraSite(torch.nn.Module):
    """The adapters of one megatron linear, computing the delta its forward hook adds."""

    def __init__(self, site: Site, geometry: Geometry, adapters: dict[str, ProjectionAdapter], spec: LoraSpec,
                 base: torch.nn.Module):
        super().__init__()
        self.site, self.geometry, self.scaling = site, geometry, spec.scaling
        self.adapters = torch.nn.ModuleDict(adapters)
        self.dropout = torch.nn.Dropout(spec.dropout) if spec.dropout else torch.nn.Identity()
        self.sequence_parallel = bool(getattr(base, "sequence_parallel", False))
        self.group = getattr(base, "tp_group", None)
        self._mark(base)

    def _mark(self, base) -> None:
        """megatron's attributes: TP-split matrices (grad norm counts them on every rank), and the
        replicated ones whose gradient is a per-rank partial sum under sequence parallelism."""
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes
        tp = self.geometry.tp  # the run's layout's (``attach``)
        for adapter in self.adapters.values():
            split, whole = ((adapter.A,), list(adapter.B)) if self.site.kind == ROW_LINEAR else \
                (list(adapter.B), (adapter.A,))
            for p in split:
                if tp > 1:
                    set_tensor_model_parallel_attributes(p, True, 1 if self.site.kind == ROW_LINEAR else 0, 1)
            for p in whole:
                p.sequence_parallel = self.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The delta for the base's output: ``[s, b, out / tp]`` (column) or ``[s(/tp), b, out]``
        (row), in the base output's layout."""
        if self.site.kind == ROW_LINEAR:
            return self._row(x)
        return self._column(x)

    def _drops(self) -> bool:
        return not isinstance(self.dropout, torch.nn.Identity) and self.training

    def _dropped(self, x: torch.Tensor) -> torch.Tensor:
        """Dropout on the adapters' input: where x is the same on every TP rank (column, no SP)
        from the default generator, alike on the TP ranks; elsewhere from megatron's TP stream."""
        if not self._drops():
            return x
        if self.site.kind != ROW_LINEAR and not self.sequence_parallel:
            return self.dropout(x)
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        with get_cuda_rng_tracker().fork():
            return self.dropout(x)

    def _row(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            reduce_from_tensor_model_parallel_region,
            reduce_scatter_to_sequence_parallel_region,
        )
        [adapter] = self.adapters.values()
        h = self._dropped(x) @ adapter.A.t()
        h = reduce_scatter_to_sequence_parallel_region(h, group=self.group) if self.sequence_parallel else \
            reduce_from_tensor_model_parallel_region(h, group=self.group)
        return (h @ adapter.B[0].t()) * self.scaling

    def _column(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (
            copy_to_tensor_model_parallel_region,
            gather_from_sequence_parallel_region,
        )
        adapters = list(self.adapters.values())
        if self._drops():  # peft draws one mask per projection, in the projections' order
            h = torch.cat([self._dropped(x) @ ad.A.t() for ad in adapters], dim=-1)
        else:
            a = torch.cat([ad.A for ad in adapters]) if len(adapters) > 1 else adapters[0].A
            h = x @ a.t()  # [.., n x r]: one matmul and one collective for every projection
        h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=True, group=self.group) \
            if self.sequence_parallel else copy_to_tensor_model_parallel_region(h, group=self.group)
        blocks = dict(zip(self.adapters.keys(), h.split(adapters[0].A.shape[0], dim=-1)))
        outs = []
        for module in self.site.projections:
            if module is None:
                outs.append(None)
                continue
            name = short_name(module)
            outs += [(blocks[name] @ b.t()) * self.scaling for b in self.adapters[name].B]
        return self._fused(outs, h)

    def _fused(self, outs: list[torch.Tensor | None], h: torch.Tensor) -> torch.Tensor:
        """The blocks' deltas in the fused output's layout: QKV per KV group [q, k, v]; else in a
        row. A projection without adapter contributes zeros of its width."""
        outs = [o if o is not None else h.new_zeros(*h.shape[:-1], w) for o, w in zip(outs, self.geometry.widths)]
        if self.site.kind != QKV:
            return torch.cat(outs, dim=-1)
        return torch.cat([o.unflatten(-1, (self.geometry.groups, -1)) for o in outs], dim=-1).flatten(-2)


def _add_delta(module, args, kwargs, output):
    """Forward hook of an adapted megatron linear: its output plus the adapters' delta."""
    x = args[0] if args else kwargs["input_"]
    y, bias = output
    return y + getattr(module, LORA_CHILD)(x).to(y.dtype), bias


# --- attaching to the model chunks ----------------------------------------------------------------------

def attach(chunks, family, hf_config, spec: LoraSpec, adapters: dict[str, torch.Tensor], lay: Layout,
           tp_rank: int) -> None:
    """Freeze every parameter of ``chunks`` but those of ``modules_to_save`` (the embedding, the LM
    head) and give each adapted linear its adapters: this rank's slices (at ``lay``'s tp, its padded
    vocabulary) of ``adapters`` (HF-PEFT names, HF shapes, e.g. ``draw_adapters``'s), in the base's
    dtype and device."""
    dims, tp = family.dims(hf_config, lay.padded_vocab), lay.tp
    saved = megatron_saved(family, hf_config, spec)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            p.requires_grad_(name in saved)
        _replay_under_full_recompute(chunk)
        for layer in chunk.decoder.layers:
            for site in megatron_sites(family, hf_config, spec, [layer.layer_number - 1]):
                base = layer.get_submodule(site.mcore)
                geometry = Geometry(site, dims, tp, base.weight.shape[0])
                mine = {}
                for module in filter(None, site.projections):
                    a_name, b_name = peft_names(module)
                    a, b_parts = shard_adapter(site, geometry, adapters[a_name], adapters[b_name], tp, tp_rank)
                    like = base.weight
                    mine[short_name(module)] = ProjectionAdapter(a.to(like.device, like.dtype),
                                                                 [b.to(like.device, like.dtype) for b in b_parts])
                setattr(base, LORA_CHILD, LoraSite(site, geometry, mine, spec, base))
                # first of its hooks: the delta joins the projection's own output (before a post norm)
                base.register_forward_hook(_add_delta, with_kwargs=True, prepend=True)


def _replay_under_full_recompute(chunk) -> None:
    """Make the first stage's decoder input require grad under megatron's full recompute. Its
    checkpoint is reentrant: each layer runs under ``no_grad`` and is replayed in backward only if
    its input requires grad, which a frozen embedding's output does not; the adapters then got no
    gradient at all (all zero, and the run trained nothing). HF's ``enable_input_require_grads``
    does the same for peft."""
    embedding = getattr(chunk, "embedding", None)
    if embedding is None or chunk.config.recompute_granularity != "full":
        return

    def requires_grad(module, args, output):
        return output if output.requires_grad else output.requires_grad_(True)
    embedding.register_forward_hook(requires_grad)


def chunk_sites(chunk) -> list[tuple[str, LoraSite]]:
    """(global module name, LoraSite) of every adapted linear in a model chunk."""
    out = []
    for layer in chunk.decoder.layers:
        for name, module in layer.named_modules():
            if isinstance(module, LoraSite):
                out.append((f"decoder.layers.{layer.layer_number - 1}.{name}", module))
    return out


# --- every adapter whole, in HF-PEFT names (exports, checkpoints, parity checks) --------------------------

def gather_adapters(engine, attr: str | None = None) -> dict[str, torch.Tensor] | None:
    """Every adapter matrix (the optimizer's fp32 main copy, as the DeepSpeed path exports its fp32
    masters; or ``attr`` of each parameter: ``main_grad``) in HF-PEFT names and HF shapes, fp32 on
    the CPU, on global rank 0; None elsewhere. Collective: the replica an export takes (DP rank 0)
    sends its TP slices of its stages' adapters to rank 0, which joins them; adapters are small
    (r x (in + out) per projection)."""
    import torch.distributed as dist
    mine = {}
    for chunk in engine.model:
        for _, site in chunk_sites(chunk.module):
            for module in filter(None, site.site.projections):
                adapter = site.adapters[short_name(module)]
                params = [adapter.A, *adapter.B]
                tensors = [getattr(t, attr) for t in params] if attr else main_params(engine, params)
                if engine.owns_dense:
                    mine[module] = (site.site, engine.tp_rank, [t.detach().to("cpu", torch.float32, copy=True)
                                                               for t in tensors])
    every = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, every, dst=0)
    if dist.get_rank() != 0:
        return None
    shards: dict[str, tuple[Site, dict[int, list]]] = {}
    for rank_adapters in every:
        for module, (site, tp_rank, tensors) in rank_adapters.items():
            shards.setdefault(module, (site, {}))[1][tp_rank] = tensors
    out = {}
    for module, (site, by_rank) in shards.items():
        ordered = [by_rank[r] for r in sorted(by_rank)]
        a_name, b_name = peft_names(module)
        out[a_name], out[b_name] = unshard_adapter(site, [t[0] for t in ordered], [t[1:] for t in ordered])
    return out


# --- adapter-only checkpoints ---------------------------------------------------------------------------

def _named_adapter_params(engine) -> dict[str, torch.nn.Parameter]:
    """This rank's adapter matrices by checkpoint key: the HF-PEFT name of A and of B (a packed
    projection's B parts as ``<B name>.part<k>``), the same at every layout; and the parameters of
    modules to save under their megatron names (``embedding.word_embeddings.weight``)."""
    out = {}
    for chunk in engine.model:
        for _, site in chunk_sites(chunk.module):
            for module in filter(None, site.site.projections):
                adapter = site.adapters[short_name(module)]
                a_name, b_name = peft_names(module)
                out[a_name] = adapter.A
                parts = list(adapter.B)
                out.update({b_name: parts[0]} if len(parts) == 1 else
                           {f"{b_name}.part{k}": b for k, b in enumerate(parts)})
        out.update({n: p for n, p in chunk.module.named_parameters() if p.requires_grad and not is_adapter_name(n)})
    return out


def sharded_adapters(engine) -> dict:
    """megatron ``ShardedTensor``s of this rank's adapters, keyed by their HF-PEFT names: TP-split
    ones along their split dim (megatron reshards them to any TP), the others replicated. With the
    distributed optimizer's ``fully_reshardable`` state over them, an adapter-only checkpoint that
    loads at any TP/PP/DP."""
    from megatron.core.utils import (
        make_sharded_tensor_for_checkpoint,
        make_tp_sharded_tensor_for_checkpoint,
    )
    out, in_full = {}, _trained_in_full(engine)
    for key, param in _named_adapter_params(engine).items():
        if key in in_full:
            continue
        if getattr(param, "tensor_model_parallel", False):
            out[key] = make_tp_sharded_tensor_for_checkpoint(param, key, tp_axis=param.partition_dim)
        else:
            out[key] = make_sharded_tensor_for_checkpoint(param, key)
    for chunk in engine.model:  # modules to save: as megatron shards them (the vocabulary over TP)
        trained = _trained_in_full(engine, chunk)
        if trained:
            whole = chunk.module.sharded_state_dict()
            out.update({name: whole[name] for name in trained})
    return out


def _trained_in_full(engine, chunk=None) -> set[str]:
    """Names (top-level: the same in every chunk) of a chunk's (default: all chunks') parameters of
    modules to save."""
    chunks = engine.model if chunk is None else [chunk]
    return {n for c in chunks for n, p in c.module.named_parameters() if p.requires_grad and not is_adapter_name(n)}


def load_adapters(engine, loaded: dict[str, torch.Tensor]) -> None:
    """This rank's adapters from a loaded ``sharded_adapters`` dict (exactly its keys)."""
    params = _named_adapter_params(engine)
    missing, unexpected = sorted(set(params) - set(loaded)), sorted(set(loaded) - set(params))
    if missing or unexpected:
        raise RuntimeError(f"LoRA checkpoint does not hold this run's adapters: missing {missing[:4]}, unexpected "
                           f"{unexpected[:4]} (is it from a run with the same lora.* settings?)")
    with torch.no_grad():
        for key, param in params.items():
            param.copy_(loaded[key])


def main_params(engine, params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    """The distributed optimizer's fp32 main copies of ``params`` (dense: adapters never sit on
    experts), whole on every rank of the DP group: each rank owns a range of each parameter's
    elements, or none, and the ranges are summed over the group. In bf16 the model holds rounded
    copies; in fp32 these equal the parameters. Collective over the DP (x CP) group: its ranks call it for
    the same parameters in the same order."""
    import torch.distributed as dist
    optimizers = getattr(engine.optimizer, "chained_optimizers", [engine.optimizer])
    out = []
    for param in params:
        whole = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
        for holder in (o for o in optimizers if param in o.model_param_group_index_map):  # owns a range
            owned = holder._get_model_param_range_map(param)["param"]
            main = holder._get_main_param_and_optimizer_states(param)["param"]
            whole[owned.start:owned.end] = main.detach().reshape(-1).float()
        dist.all_reduce(whole, group=grid.dp_cp_group())  # the optimizer shards over dp x cp
        out.append(whole.view(param.shape))
    return out

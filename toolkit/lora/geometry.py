"""LoRA on megatron, the pure part: which megatron linear of a layer carries which HF
projections' adapters (``Site``, read off the family's weight table), what the megatron path
cannot adapt (refused in the plan, naming the fix), and how one projection's adapter ``A [r, in]``,
``B [out, r]`` splits over TP and joins back (``Geometry``, ``shard_adapter``/``unshard_adapter``).
Shapes and names only: the adapted linears themselves, which call megatron-core, are
``adapters/megatron/lora.py``'s; the converter reads and writes megatron LoRA checkpoints with this.
"""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict

from toolkit.config import ConfigError
from toolkit.lora.spec import LoraSpec, matches, saved_matches

QKV, GLU, COLUMN_LINEAR, ROW_LINEAR = "qkv", "glu", "column", "row"
"""How a megatron linear's output (column) or input (row) is laid out over its HF projections."""


class Site(BaseModel):
    """One megatron linear of one layer that carries adapters (``toolkit/adapters/megatron/lora.py``).

    ``projections``: the HF modules whose weights the linear fuses, in the table's order (q, k, v;
    gate, up; or one), each with the HF name (``model.layers.3.self_attn.q_proj``) or None where
    that projection has no adapter (``target_modules=[q_proj, v_proj]``). ``parts``: for a packed HF
    module (GPT-2's ``c_attn`` = [q; k; v], Phi-3's ``gate_up_proj``) the number of row blocks of
    its B that land in separate parts of the fused output; else 1."""
    model_config = ConfigDict(frozen=True)

    layer: int
    mcore: str
    """The linear's module name in the layer (``self_attention.linear_qkv``)."""
    kind: str
    projections: list[str | None]
    parts: int = 1


def megatron_sites(family, hf_config, spec: LoraSpec, layers) -> list[Site]:
    """The adapted megatron linears of ``layers`` (global numbers), read off the family's weight
    table: each table entry of a layer's ``.weight`` names the HF modules it fuses. Routed experts
    are never adapted (the plan refused them); a replicated linear (router, shared expert gate)
    never is either."""
    from toolkit.families.base import COLUMN, ROW, FuseGLU, FuseQKV
    out = []
    for layer in layers:
        prefix = family.hf_layer.format(i=layer)
        for entry in family.layer:
            if not all(n.endswith(".weight") for n in entry.hf_names()):
                continue
            modules = [prefix + n.removesuffix(".weight") for n in entry.hf_names()]
            adapted = [m if any(matches(m, t) for t in spec.targets) else None for m in modules]
            if not any(adapted):
                continue
            kind = (QKV if isinstance(entry, FuseQKV) else GLU if isinstance(entry, FuseGLU)
                    else {COLUMN: COLUMN_LINEAR, ROW: ROW_LINEAR}.get(entry.split))
            if kind is None:
                raise ConfigError(f"lora.target_modules: {adapted} is replicated over TP in megatron "
                                  f"({entry.mcore}); LoRA adapts column- and row-parallel linears only")
            parts = {QKV: 3, GLU: 2}.get(kind, 1) if len(modules) == 1 else 1
            out.append(Site(layer=layer, mcore=entry.mcore.removesuffix(".weight"), kind=kind, projections=adapted,
                            parts=parts))
    return out


def check_megatron_lora(spec: LoraSpec, family, hf_config) -> None:
    """What the megatron path cannot do of a resolved spec, as errors naming the fix (modules to
    save other than the embedding and LM head); and every module the spec
    adapts must sit in a megatron linear the table knows."""
    megatron_saved(family, hf_config, spec)
    sites = megatron_sites(family, hf_config, spec, range(hf_config.num_hidden_layers))
    found = sum(p is not None for s in sites for p in s.projections)
    if found != spec.adapted:
        raise ConfigError(f"lora.target_modules={spec.targets}: peft adapts {spec.adapted} modules of this model, "
                          f"megatron's layers carry {found} of them; target the attention and MLP projections "
                          "(or use backend=deepspeed)")


def megatron_saved(family, hf_config, spec: LoraSpec) -> dict[str, str]:
    """megatron name -> HF name of each tensor trained in full (``modules_to_save``): the embedding
    and the untied LM head (the table's vocabulary-split top entries); a name that peft's rule
    (``saved_matches``) also finds elsewhere (``norm``: every layer's norms too) is refused by name."""
    from toolkit.families import table
    from toolkit.families.base import VOCAB
    entries = table(family, hf_config)
    out = {}
    for name in spec.modules_to_save:
        hits = {mcore: prefix + hf for mcore, (entry, prefix) in entries.items() for hf in entry.hf_names()
                if saved_matches(prefix + hf.rsplit(".", 1)[0], name)}
        others = sorted(hf for mcore, hf in hits.items() if getattr(entries[mcore][0], "split", None) != VOCAB)
        if not hits or others:
            named = f" (peft would train {', '.join(others[:3])} in full)" if others else ""
            raise ConfigError(f"lora.modules_to_save: {name!r} on megatron: only the embedding and the LM head can "
                              f"be trained in full beside the adapters{named}; leave it out or set backend=deepspeed")
        out.update(hits)
    return out


# --- one rank's slices of an adapter, and back -----------------------------------------------------

class Geometry:
    """A column site's fused output on one TP rank as row blocks (q, k, v; gate, up; or one), and
    how a projection's HF B splits into them."""

    def __init__(self, site: Site, dims, tp: int, out_local: int):
        self.site, self.tp = site, tp
        if site.kind == QKV:
            q, kv = dims.heads * dims.head_dim, dims.groups * dims.head_dim
            self.hf_rows = [q, kv, kv]
            self.groups = dims.groups // tp
        else:
            self.hf_rows, self.groups = None, None
        self.widths = ([r // tp for r in self.hf_rows] if site.kind == QKV
                       else [out_local // 2] * 2 if site.kind == GLU else [out_local])
        """This rank's rows of each block of the fused output."""

    def b_parts(self, b: torch.Tensor) -> list[torch.Tensor]:
        """The HF B ``[out, r]`` of one projection as its row blocks (one, or [q; k; v] / [gate; up]
        for a packed projection)."""
        if self.site.parts == 1:
            return [b]
        return list(torch.split(b, self.hf_rows or [b.shape[0] // self.site.parts] * self.site.parts))


def shard_adapter(site: Site, geometry: Geometry, a: torch.Tensor, b: torch.Tensor, tp: int,
                  rank: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """TP rank ``rank``'s A and B parts of one projection's HF ``a [r, in]``, ``b [out, r]``."""
    if site.kind == ROW_LINEAR:
        return torch.chunk(a, tp, dim=1)[rank].contiguous(), [b.contiguous()]
    return a.contiguous(), [torch.chunk(p, tp, dim=0)[rank].contiguous() for p in geometry.b_parts(b)]


def unshard_adapter(site: Site, a_parts: list[torch.Tensor], b_parts: list[list[torch.Tensor]]):
    """The HF ``(a, b)`` from every TP rank's A and B parts (in rank order). The matrix every TP
    rank holds whole must be the same on all of them (else a rank's gradient or dropout mask
    differed: an error, not one rank's copy picked)."""
    whole = [p[0] for p in b_parts] if site.kind == ROW_LINEAR else a_parts
    if any(not torch.equal(w, whole[0]) for w in whole[1:]):
        raise RuntimeError(f"LoRA: the TP ranks' copies of the replicated adapter matrix of {site.projections} "
                           f"(layer {site.layer}, {site.mcore}) differ")
    if site.kind == ROW_LINEAR:
        return torch.cat(a_parts, dim=1), whole[0]
    blocks = [torch.cat([rank_parts[k] for rank_parts in b_parts]) for k in range(len(b_parts[0]))]
    return a_parts[0], torch.cat(blocks)

"""torchtitan's names of a family's model: the family's ``torchtitan`` field (its facts stay in the
family's file); the torchtitan checkpoint source (``toolkit/formats/dcp.py``) reads through it."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

import torch


@dataclass(frozen=True)
class TorchtitanNames:
    """The family's model as torchtitan names it in its own state dict (its ``step-N/`` DCP
    checkpoints): torchtitan name -> HF checkpoint name, for the whole model (``top``) and per decoder
    layer (``layer``: relative to ``layers.{i}.`` and to ``Family.hf_layer``). A name may have several
    torchtitan spellings (its releases renamed some: ``attention.wq`` became
    ``attention.qkv_linear.wq``, ``output`` became ``lm_head``)."""
    top: Mapping[str, str]
    layer: Mapping[str, str]
    interleaved_rope: bool = False
    """torchtitan rotates adjacent pairs of each head's dims (complex RoPE: Llama 3), HF the two
    halves (``rotate_half``): its q/k projection rows are those of HF's permuted within each head."""
    layer_prefix: str = "layers.{i}."
    rotated: tuple[str, ...] = ("self_attn.q_proj.weight", "self_attn.k_proj.weight")
    """HF names (relative to the layer) whose rows are the heads' rotated dims."""

    def extend(self, **changes) -> "TorchtitanNames":
        for key in ("top", "layer"):
            if key in changes:
                changes[key] = {**getattr(self, key), **changes[key]}
        return dataclasses.replace(self, **changes)

    def hf_name(self, name: str, hf_layer: str) -> str | None:
        """The HF name of torchtitan's ``name``; None for a name not in the table."""
        if name in self.top:
            return self.top[name]
        head, _, _ = self.layer_prefix.partition("{i}")
        if name.startswith(head):
            index, _, rest = name[len(head):].partition(".")
            if index.isdigit() and rest in self.layer:
                return hf_layer.format(i=int(index)) + self.layer[rest]
        return None

    def to_hf(self, hf_name: str, x: torch.Tensor, head_dim: int) -> torch.Tensor:
        """torchtitan's tensor (a weight or its Adam moment) as HF lays it out: with interleaved RoPE,
        each head's rows (2j, 2j+1) become rows (j, j + head_dim/2)."""
        if not (self.interleaved_rope and hf_name.endswith(self.rotated)):
            return x
        rows, rest = x.shape[0], x.shape[1:]
        return x.reshape(rows // head_dim, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)

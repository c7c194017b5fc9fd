"""Mixture of experts in the estimate: what the experts' parameters cost to hold and to move under the
three ways the toolkit can train them, side by side (``toolkit estimate`` prints the table for every
MoE model, so a user sees which to pick before launching):

- ZeRO-3, experts gathered (no expert parallelism): every rank computes every expert for its own
  tokens, so every expert's weights are all-gathered over the whole ZeRO world, forward and backward
  of every micro-batch (the existing ZeRO-3 rows, of which the experts' share is shown).
- ZeRO with expert parallelism (``zero.ep``, DeepSpeed's AutoEP): each of ep ranks holds E / ep
  experts; a rank's routed tokens travel to their experts' ranks and back by all-to-all. Per MoE layer
  and micro-batch each rank sends ``T·k·h·w`` bytes (T tokens of the rank, k experts per token, h
  hidden, w the activation dtype's bytes), twice forward (dispatch, combine), twice backward, twice
  more when activation checkpointing recomputes the forward. Experts' weights below stage 3 are
  ``Φ_x / ep`` per rank; gradients and optimizer state of an expert are sharded over the W / ep
  expert-data-parallel ranks that hold it (``Φ_x / W`` each at stages 1-3, as without EP); the
  dispatched rows (``2·T·k·h·w`` per MoE layer) are kept for the backward.
- megatron EP (``megatron.ep``): its ``allgather`` dispatcher gathers every rank's tokens over the
  tp x ep group (hidden states ``T·h·w`` per rank, the routing probabilities ``T·E·w`` and the routing
  map ``T·E`` bytes) and reduce-scatters the experts' output back, forward; backward the reverse
  (reduce-scatter of the hidden states' and probabilities' gradients, all-gather of the output's);
  again forward under full recompute. ``alltoall``: as ZeRO EP, over ep. Expert gradients are reduced
  over the dp / ep expert-data-parallel ranks.

Each collective is priced by ``steptime.collective_seconds`` (alpha-beta, no overlap). ``zero_ep`` is the
one place the DeepSpeed estimate reads ``zero.ep`` (the key of the AutoEP branch; until it exists the
comparison takes ``--ep``).
"""
from __future__ import annotations

from dataclasses import dataclass

from toolkit.config import RunConfig
from toolkit.plan.model import ModelSpec


def zero_ep(cfg: RunConfig) -> int:
    """``zero.ep``: DeepSpeed's AutoEP expert parallelism (1: none)."""
    return cfg.zero.ep


@dataclass(frozen=True)
class MoeShape:
    layers: int
    """MoE layers (layers with routed experts)."""
    experts: int
    top_k: int
    params: int
    """Routed experts' parameters of the whole model (Φ_x)."""
    largest_layer: int
    """Routed experts' parameters of the largest MoE layer."""


def moe_shape(spec: ModelSpec) -> MoeShape | None:
    """The routed experts of ``spec``; None for a dense model."""
    per_layer = spec.per_layer_experts or []
    if not spec.experts or not any(per_layer):
        return None
    return MoeShape(layers=sum(1 for p in per_layer if p), experts=spec.experts, top_k=spec.experts_per_token,
                    params=sum(per_layer), largest_layer=max(per_layer))


def all_to_all_passes(recompute: str) -> int:
    """Token all-to-alls per MoE layer and micro-batch: dispatch and combine, forward and backward, and
    the forward again under full recompute (activation checkpointing)."""
    return 6 if recompute == "full" else 4


def dispatch_bytes(cfg: RunConfig, spec: ModelSpec, w: int, seq_split: int = 1) -> float:
    """One all-to-all's send buffer of one rank: its ``T·k`` routed token copies of ``h`` values."""
    tokens = cfg.train.micro_batch_size * cfg.data.seq_len / seq_split
    return tokens * spec.experts_per_token * spec.hidden * w

"""Grouped expert matmuls on the megatron path (``model.experts_implementation``) without Transformer
Engine or the CUDA-only ``grouped_gemm`` package: ``GroupedSequentialMLP``, megatron-core's
``SequentialMLP`` with the same parameters, names and ``sharded_state_dict`` (checkpoints, the converter
and LoRA's names are unchanged), whose forward runs one ``torch._grouped_mm`` per projection over all
local experts instead of a Python loop of per-expert MLPs.

megatron-core 0.16's own grouped experts do not fit: ``GroupedMLP`` (``moe_grouped_gemm=True`` with the
local spec) imports ``grouped_gemm`` (a CUDA extension), runs bf16 only and stores the experts
transposed as ``[H, E_local * 2F]`` (optimizer state incompatible with ``SequentialMLP``'s);
``TEGroupedMLP`` needs Transformer Engine. ``TransformerConfig.moe_grouped_gemm`` therefore stays
False and the layer spec's experts module is swapped (``adapters/megatron/model.py``).

Per layer, with ``x [N, H]`` the dispatcher's tokens sorted by local expert, ``tokens_per_expert
[E_local]`` and ``probs [N]``: ``offs = cumsum(tokens_per_expert)`` (int32, as ``torch._grouped_mm``
requires), ``h = x @ W1_e^T`` per group with ``W1 [E_local, 2F/tp, H]`` stacked from the experts'
``linear_fc1.weight`` (``[gate_r; up_r]`` rows per TP rank, as megatron lays out its fused GLU), then
megatron's ``MLP`` activation (``act(gate) * (up + glu_linear_offset)``, clamped where configured), the
routing probabilities applied after it and cast back to the activations' dtype (megatron's
``per_token_scale``), and ``W2 [E_local, H, F/tp]``. An expert with no tokens is an empty group: its
gradient is zero, not missing. Expert linears do no TP communication themselves (megatron builds them
``is_expert``; the dispatcher does), so the weights are all there is.
"""
from __future__ import annotations

from functools import lru_cache

import torch

GROUPED, EAGER = "grouped_mm", "eager"
"""The implementation names in transformers' vocabulary (``model.experts_implementation``); ``eager`` is
megatron-core's ``SequentialMLP``."""


@lru_cache(maxsize=None)
def grouped_mm_runs(dtype: torch.dtype, device_type: str) -> str | None:
    """None when ``torch._grouped_mm`` runs forward and backward in ``dtype`` on ``device_type`` (two
    groups, one of them empty); else why not. Once per process, per dtype and device type."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        x = torch.randn(8, 16, dtype=dtype, device=device_type, requires_grad=True)
        w = torch.randn(2, 16, 16, dtype=dtype, device=device_type, requires_grad=True)
        offs = torch.tensor([0, 8], dtype=torch.int32, device=device_type)
        # square: a plain sum's gradient is an expanded (stride 0) tensor, which torch 2.13's CPU
        # backward refuses ("Invalid strides/sizes"); the dispatcher's unpermute gives a dense one
        torch._grouped_mm(x, w, offs=offs).square().sum().backward()
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        return f"torch._grouped_mm failed in {dtype} on {device_type}: {str(exc).splitlines()[0][:200]}"
    return None


def grouped_problems(tconfig) -> list[str]:
    """What in ``tconfig`` the grouped module does not compute (it would fall back to, or refuse in
    favour of, ``SequentialMLP``); empty where it computes exactly what ``SequentialMLP`` does."""
    problems = []
    if tconfig.add_bias_linear:
        problems.append("expert linears with biases (add_bias_linear)")
    if getattr(tconfig, "fp8", None) or getattr(tconfig, "fp4", None):
        problems.append("fp8/fp4 experts")
    if tconfig.moe_apply_probs_on_input:
        problems.append("moe_apply_probs_on_input")
    return problems


def choose(requested: str, tconfig) -> tuple[str, str | None]:
    """The experts implementation for ``requested`` (``auto``, ``eager``, ``grouped_mm``) on this rank:
    (``grouped_mm`` or ``eager``, why ``auto`` fell back or None). An explicit ``grouped_mm`` that cannot
    run raises ``ConfigError`` naming the reason and the fix."""
    from toolkit import device
    from toolkit.config import ConfigError
    if requested == EAGER:
        return EAGER, None
    problems = grouped_problems(tconfig)
    probe = grouped_mm_runs(tconfig.params_dtype, device.rank_device().type)
    reason = "; ".join(problems + ([probe] if probe else [])) or None
    if reason is None:
        return GROUPED, None
    if requested == GROUPED:
        raise ConfigError(f"model.experts_implementation=grouped_mm cannot run here: {reason}; set "
                          "model.experts_implementation=eager (megatron's sequential experts) or auto")
    return EAGER, reason


@lru_cache(maxsize=1)
def grouped_sequential_mlp_class():
    """``GroupedSequentialMLP`` (megatron imported on first use)."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from toolkit import device

    class GroupedSequentialMLP(SequentialMLP):
        """``SequentialMLP``'s parameters and checkpoints; one ``torch._grouped_mm`` per projection.
        Where a hook sits on an expert linear (LoRA's adapters, ``adapters/megatron/lora.py``), the
        experts run one by one as ``SequentialMLP`` runs them, hooks included."""

        def forward(self, permuted_local_hidden_states, tokens_per_expert, permuted_probs):
            if self.hooked():
                return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
            x = permuted_local_hidden_states
            # the dispatcher sizes the experts on the host: one host -> device copy, no sync (the rank's
            # device object, so strict mode's sync counter on a CPU sees a move to the device too)
            offs = torch.cumsum(tokens_per_expert.to(device.rank_device()), 0, dtype=torch.int32)
            w1 = torch.stack([e.linear_fc1.weight for e in self.local_experts])  # [E_l, 2F/tp, H]
            w2 = torch.stack([e.linear_fc2.weight for e in self.local_experts])  # [E_l, H, F/tp]
            h = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs)  # [N, 2F/tp]
            h = self._activation(h)
            scaled = (h * permuted_probs.unsqueeze(-1)).to(h.dtype)  # megatron's per_token_scale
            return torch._grouped_mm(scaled, w2.transpose(-2, -1), offs=offs), None

        def _activation(self, h: torch.Tensor) -> torch.Tensor:
            """megatron's ``MLP`` activation (unfused): GLU ``act(gate) * (up + offset)`` or ``act(h)``."""
            config = self.config
            if not config.gated_linear_unit:
                return config.activation_func(h)
            gate, up = torch.chunk(h, 2, dim=-1)
            if (clamp := config.activation_func_clamp_value) is not None:
                gate, up = gate.clamp(min=None, max=clamp), up.clamp(min=-clamp, max=clamp)
            return config.activation_func(gate) * (up + config.glu_linear_offset)

        def hooked(self) -> bool:
            """Whether a forward hook sits on an expert linear (then the grouped matmul would skip it)."""
            return any(m._forward_hooks or m._forward_pre_hooks
                       for e in self.local_experts for m in (e.linear_fc1, e.linear_fc2))

    return GroupedSequentialMLP

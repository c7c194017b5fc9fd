"""Megatron's expert modules built without process groups, for the unit tests and the GPU layer of
``toolkit/adapters/megatron/experts.py``: ``SequentialMLP`` or the toolkit's grouped module on the same
seeded weights, expert linears as megatron runs them under EP or TP (``explicit_expert_comm``: no
communication of their own), and one forward and backward of fixed inputs."""
from __future__ import annotations

import torch
import torch.nn.functional as F

TOKENS_PER_EXPERT = [5, 0, 7, 3]  # expert 1 receives no token
EMPTY_EXPERT_WEIGHTS = ("local_experts.1.linear_fc1.weight", "local_experts.1.linear_fc2.weight")


class _OneRank:
    """A process group of one (megatron's expert modules ask its size and rank)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def experts_module(kind: str, activation=F.silu, glu: bool = True, dtype=torch.float32, device: str = "cpu"):
    """``kind``: ``sequential`` (megatron-core's SequentialMLP) or ``grouped`` (the toolkit's), hidden 32,
    expert width 24, ``len(TOKENS_PER_EXPERT)`` experts, weights drawn with seed 0 (alike for both)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from toolkit.adapters.megatron.experts import grouped_sequential_mlp_class
    tconfig = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=24,
                                moe_ffn_hidden_size=24, num_moe_experts=len(TOKENS_PER_EXPERT), gated_linear_unit=glu,
                                activation_func=activation, add_bias_linear=False, use_cpu_initialization=True,
                                bias_activation_fusion=False, params_dtype=dtype, bf16=dtype == torch.bfloat16)
    cls = grouped_sequential_mlp_class() if kind == "grouped" else SequentialMLP
    groups = ProcessGroupCollection(ep=_OneRank(), expt_tp=_OneRank(), expt_dp=_OneRank())
    module = cls(len(TOKENS_PER_EXPERT), tconfig, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear), pg_collection=groups)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for expert in module.local_experts:
            for linear in (expert.linear_fc1, expert.linear_fc2):
                linear.explicit_expert_comm = True  # as under EP or TP: the dispatcher communicates
                linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) * 0.5)
    return module.to(device)


def forward_backward(module, dtype=torch.float32, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Output and gradients (input, probs, every weight) of sum(out x a fixed random tensor), in fp32
    on the CPU."""
    g = torch.Generator().manual_seed(1)
    rows = sum(TOKENS_PER_EXPERT)
    x = torch.randn(rows, 32, generator=g).to(device, dtype).requires_grad_()
    probs = torch.rand(rows, generator=g).to(device).requires_grad_()  # megatron's probs stay fp32
    out, bias = module(x, torch.tensor(TOKENS_PER_EXPERT), probs)
    assert bias is None
    (out.float() * torch.randn(out.shape, generator=g).to(device)).sum().backward()
    grads = {n: p.grad.float().cpu() for n, p in module.named_parameters()}
    return {"out": out.detach().float().cpu(), "x": x.grad.float().cpu(), "probs": probs.grad.cpu(), **grads}


def gaps(got: dict, ref: dict) -> dict[str, float]:
    """Per tensor: max |got - ref| relative to max |ref|."""
    return {k: ((got[k] - r).abs().max() / r.abs().max().clamp(min=1e-30)).item() for k, r in ref.items()}

"""The megatron path's grouped experts (``toolkit/adapters/megatron/experts.py``) against megatron-core's own
``SequentialMLP`` on the same weights, in one process (expert linears as megatron runs them under EP or
TP: ``explicit_expert_comm``, no communication of their own): outputs and the gradients of the input, the
routing probabilities and every expert weight, an expert without tokens included (a zero gradient, not
a missing one); SwiGLU and a plain GeLU; the choice ``auto`` / ``grouped_mm`` / ``eager`` makes. Through
whole engines at EP=2 x TP=2: tests/distributed/test_megatron_experts.py."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from toolkit.config import ConfigError

TOKENS_PER_EXPERT = [5, 0, 7, 3]  # expert 1 receives no token
FP32_RTOL = 1e-6  # measured 0 (the same products and sums, per group)
BF16_RTOL = 2e-2
"""bf16, each against the fp32 SequentialMLP, relative to the largest entry: grouped_mm no further than
1.5 x eager + this slack (measured: both within 8e-3 of the output, 1.6e-2 of the weights' gradients)."""


class _OneRank:
    """A process group of one (megatron's expert modules ask its size and rank)."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _experts(cls_name: str, activation=F.silu, glu: bool = True, dtype=torch.float32, **config):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP

    from toolkit.adapters.megatron.experts import grouped_sequential_mlp_class
    tconfig = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=24,
                                moe_ffn_hidden_size=24, num_moe_experts=len(TOKENS_PER_EXPERT), gated_linear_unit=glu,
                                activation_func=activation, add_bias_linear=False, use_cpu_initialization=True,
                                bias_activation_fusion=False, params_dtype=dtype, bf16=dtype == torch.bfloat16,
                                **config)
    cls = grouped_sequential_mlp_class() if cls_name == "grouped" else SequentialMLP
    groups = ProcessGroupCollection(ep=_OneRank(), expt_tp=_OneRank(), expt_dp=_OneRank())
    torch.manual_seed(0)  # the same weights for both classes
    module = cls(len(TOKENS_PER_EXPERT), tconfig, MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                                linear_fc2=RowParallelLinear), pg_collection=groups)
    for expert in module.local_experts:
        for linear in (expert.linear_fc1, expert.linear_fc2):
            linear.explicit_expert_comm = True  # as under EP or TP: the dispatcher communicates
            torch.nn.init.normal_(linear.weight, std=0.5)
    return module


def _run(module, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Output and gradients (input, probs, every weight) of sum(out * a fixed random tensor), in fp32."""
    g = torch.Generator().manual_seed(1)
    rows = sum(TOKENS_PER_EXPERT)
    x = torch.randn(rows, 32, generator=g).to(dtype).requires_grad_()
    probs = torch.rand(rows, generator=g).requires_grad_()  # megatron's probs stay fp32
    out, bias = module(x, torch.tensor(TOKENS_PER_EXPERT), probs)
    assert bias is None
    (out.float() * torch.randn(out.shape, generator=g)).sum().backward()
    grads = {n: p.grad.float() for n, p in module.named_parameters()}
    return {"out": out.detach().float(), "x": x.grad.float(), "probs": probs.grad, **grads}


def _gaps(got: dict, ref: dict) -> dict[str, float]:
    return {k: ((got[k] - r).abs().max() / r.abs().max().clamp(min=1e-30)).item() for k, r in ref.items()}


@pytest.mark.parametrize("activation,glu", [(F.silu, True), (F.gelu, False)])
def test_grouped_equals_sequential_mlp_with_an_empty_expert(activation, glu):
    ref = _run(_experts("sequential", activation, glu))
    got = _run(_experts("grouped", activation, glu))
    assert sorted(got) == sorted(ref)  # every expert weight has a gradient
    gaps = _gaps(got, ref)
    assert max(gaps.values()) <= FP32_RTOL, gaps
    assert torch.equal(got["local_experts.1.linear_fc1.weight"], torch.zeros_like(ref["local_experts.1.linear_fc1.weight"]))
    assert all(ref[k].abs().max() > 0 for k in ref if ".1." not in k)


def test_grouped_in_bf16_is_as_close_to_fp32_as_sequential():
    ref = _run(_experts("sequential"))
    runs = {name: _gaps(_run(_experts(name, dtype=torch.bfloat16), torch.bfloat16), ref)
            for name in ("sequential", "grouped")}
    print(f"\nbf16 vs fp32, worst: sequential {max(runs['sequential'].values()):.2e} "
          f"grouped {max(runs['grouped'].values()):.2e}")
    worse = {k: (runs["grouped"][k], runs["sequential"][k]) for k in ref
             if k != "local_experts.1.linear_fc1.weight" and k != "local_experts.1.linear_fc2.weight"
             and runs["grouped"][k] > 1.5 * runs["sequential"][k] + BF16_RTOL}
    assert not worse, worse


def test_a_hooked_expert_linear_runs_the_experts_one_by_one():
    """LoRA's adapters are forward hooks on the expert linears: the grouped matmul would skip them."""
    module = _experts("grouped")
    plain = _run(module)["out"]
    module.local_experts[2].linear_fc2.register_forward_hook(lambda m, args, out: (out[0] * 2, out[1]))
    assert module.hooked()
    doubled = _run(module)["out"]
    rows = slice(TOKENS_PER_EXPERT[0], sum(TOKENS_PER_EXPERT[:3]))  # expert 2's tokens
    assert torch.allclose(doubled[rows], 2 * plain[rows]) and torch.equal(doubled[:rows.start], plain[:rows.start])


def test_choice_auto_grouped_and_eager():
    from toolkit.adapters.megatron.experts import choose, grouped_mm_runs
    assert grouped_mm_runs(torch.float32, "cpu") is None and grouped_mm_runs(torch.bfloat16, "cpu") is None
    config = _experts("sequential").config
    assert choose("auto", config) == ("grouped_mm", None)
    assert choose("eager", config) == ("eager", None)
    config.add_bias_linear = True
    assert choose("auto", config) == ("eager", "expert linears with biases (add_bias_linear)")
    with pytest.raises(ConfigError, match="model.experts_implementation=grouped_mm cannot run here: expert linears "
                                          "with biases .* set model.experts_implementation=eager"):
        choose("grouped_mm", config)

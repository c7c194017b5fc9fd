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

from tests.helpers.experts import EMPTY_EXPERT_WEIGHTS, TOKENS_PER_EXPERT, experts_module, forward_backward, gaps
from toolkit.config import ConfigError

FP32_RTOL = 1e-6  # measured 0 (the same products and sums, per group)
BF16_RTOL = 2e-2
"""bf16, each against the fp32 SequentialMLP, relative to the largest entry: grouped_mm no further than
1.5 x eager + this slack (measured: both within 1.0e-2)."""


@pytest.mark.parametrize("activation,glu", [(F.silu, True), (F.gelu, False)])
def test_grouped_equals_sequential_mlp_with_an_empty_expert(activation, glu):
    ref = forward_backward(experts_module("sequential", activation, glu))
    got = forward_backward(experts_module("grouped", activation, glu))
    assert sorted(got) == sorted(ref)  # every expert weight has a gradient
    gap = gaps(got, ref)
    assert max(gap.values()) <= FP32_RTOL, gap
    assert torch.equal(got["local_experts.1.linear_fc1.weight"], torch.zeros_like(ref["local_experts.1.linear_fc1.weight"]))
    assert all(ref[k].abs().max() > 0 for k in ref if ".1." not in k)


def test_grouped_in_bf16_is_as_close_to_fp32_as_sequential():
    ref = forward_backward(experts_module("sequential"))
    runs = {name: gaps(forward_backward(experts_module(name, dtype=torch.bfloat16), torch.bfloat16), ref)
            for name in ("sequential", "grouped")}
    print(f"\nbf16 vs fp32, worst: sequential {max(runs['sequential'].values()):.2e} "
          f"grouped {max(runs['grouped'].values()):.2e}")
    worse = {k: (runs["grouped"][k], runs["sequential"][k]) for k in ref
             if k not in EMPTY_EXPERT_WEIGHTS and runs["grouped"][k] > 1.5 * runs["sequential"][k] + BF16_RTOL}
    assert not worse, worse


def test_a_hooked_expert_linear_runs_the_experts_one_by_one():
    """LoRA's adapters are forward hooks on the expert linears: the grouped matmul would skip them."""
    module = experts_module("grouped")
    plain = forward_backward(module)["out"]
    module.local_experts[2].linear_fc2.register_forward_hook(lambda m, args, out: (out[0] * 2, out[1]))
    assert module.hooked()
    doubled = forward_backward(module)["out"]
    rows = slice(TOKENS_PER_EXPERT[0], sum(TOKENS_PER_EXPERT[:3]))  # expert 2's tokens
    assert torch.allclose(doubled[rows], 2 * plain[rows]) and torch.equal(doubled[:rows.start], plain[:rows.start])


def test_choice_auto_grouped_and_eager():
    from toolkit.adapters.megatron.experts import choose, grouped_mm_runs
    assert grouped_mm_runs(torch.float32, "cpu") is None and grouped_mm_runs(torch.bfloat16, "cpu") is None
    config = experts_module("sequential").config
    assert choose("auto", config) == ("grouped_mm", None)
    assert choose("eager", config) == ("eager", None)
    config.add_bias_linear = True
    assert choose("auto", config) == ("eager", "expert linears with biases (add_bias_linear)")
    with pytest.raises(ConfigError, match="model.experts_implementation=grouped_mm cannot run here: expert linears "
                                          "with biases .* set model.experts_implementation=eager"):
        choose("grouped_mm", config)

"""Grouped expert matmuls on the GPU (``pytest -m gpu``; ``model.experts_implementation``): in bf16,
transformers' ``grouped_mm`` experts (the DeepSpeed path) and the toolkit's grouped megatron experts
(``toolkit/adapters/megatron/experts.py``) each as close to an fp32 reference (TF32 off) as the eager
loop is; which dtypes the megatron probe accepts on the device (recorded). The CPU suite checks fp32
equality (tests/unit/test_experts_implementation.py, test_megatron_experts.py, tests/distributed/);
``TOOLKIT_GPU_TESTS_ON_CPU=1`` rehearses this file on the CPU."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.experts import EMPTY_EXPERT_WEIGHTS, experts_module, forward_backward, gaps
from tests.helpers.gpu import DEVICE, GPU_ONLY
from tests.helpers.measure import measure
from toolkit.families.tiny import tiny_model

pytestmark = [*GPU_ONLY, pytest.mark.usefixtures("strict_fp32")]

SLACK = 2e-2
"""bf16 vs fp32, per tensor: grouped no further than 1.5 x eager + SLACK (CPU: both ~1e-2 apart from
mixtral's routing flips, which hit both alike)."""


def _hf_loss_and_grads(family: str, impl: str, dtype: torch.dtype) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny_model(family).to(DEVICE, dtype).train()
    model.set_experts_implementation(impl)
    ids = torch.randint(0, model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    out = model(input_ids=ids, labels=ids, output_router_logits=True)
    out.loss.backward()
    return out.loss.item(), {n: p.grad.float().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"], ids=["qwen3", "mixtral"])  # no "moe": tests_more's -k
def test_transformers_grouped_mm_in_bf16_is_as_close_to_fp32_as_eager(family):
    ref_loss, ref = _hf_loss_and_grads(family, "eager", torch.float32)
    worst = {}
    for impl in ("eager", "grouped_mm"):
        loss, grads = _hf_loss_and_grads(family, impl, torch.bfloat16)
        measure(f"{impl} bf16 loss rel. to fp32", abs(loss - ref_loss) / ref_loss, 1e-2)
        assert abs(loss - ref_loss) <= 1e-2 * ref_loss
        worst[impl] = {n: ((grads[n] - g).norm() / g.norm()).item() for n, g in ref.items()}
    measure("worst gradient rel. norm (eager, grouped_mm)",
            (max(worst["eager"].values()), max(worst["grouped_mm"].values())))
    bad = {n: (worst["grouped_mm"][n], worst["eager"][n]) for n in ref
           if worst["grouped_mm"][n] > 1.5 * worst["eager"][n] + SLACK}
    assert not bad, bad


def test_megatron_grouped_experts_in_bf16_on_the_device():
    from toolkit.adapters.megatron.experts import grouped_mm_runs
    probes = {str(dt): grouped_mm_runs(dt, DEVICE) for dt in (torch.float32, torch.bfloat16, torch.float16)}
    measure("torch._grouped_mm probe (None: runs)", probes)
    assert probes["torch.bfloat16"] is None
    ref = forward_backward(experts_module("sequential", device=DEVICE), device=DEVICE)
    runs = {kind: gaps(forward_backward(experts_module(kind, dtype=torch.bfloat16, device=DEVICE), torch.bfloat16,
                                        DEVICE), ref) for kind in ("sequential", "grouped")}
    measure("worst bf16 gap to fp32 (sequential, grouped)",
            (max(runs["sequential"].values()), max(runs["grouped"].values())))
    bad = {k: (runs["grouped"][k], runs["sequential"][k]) for k in ref
           if k not in EMPTY_EXPERT_WEIGHTS and runs["grouped"][k] > 1.5 * runs["sequential"][k] + SLACK}
    assert not bad, bad

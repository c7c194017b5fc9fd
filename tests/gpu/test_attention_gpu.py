"""The toolkit's core attention and the megatron fusions it turns on, on the GPU (``pytest -m gpu``).

What the CPU suite cannot show: flex_attention training (torch has no CPU backward for it), the
compiled flex kernel with block masks and a softcap score_mod, sdpa's GPU kernels with GQA, and
megatron's torch-compiled SwiGLU and bias-dropout-add against the unfused ops. fp32 with TF32 off;
references in float64 (tests/helpers/attention.py). ``TOOLKIT_GPU_TESTS_ON_CPU=1`` runs the sdpa case.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.attention import CASES, DOCS, D, qkv, reference_attention, reference_mask
from tests.helpers.gpu import DEVICE, GPU_ONLY, expected_kernel
from tests.helpers.measure import measure
from toolkit.adapters import attention as attention_module
from toolkit.adapters.attention import flex_unavailable
from toolkit.adapters.megatron.attention import TokenLayout, attend, choose_kernel

pytestmark = [*GPU_ONLY, pytest.mark.usefixtures("strict_fp32")]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA only (flex_attention has no CPU backward; the fusions are GPU-only)")


def _compare(mode: str, case: str) -> float:
    docs, window, softcap = CASES[case]
    ids = torch.zeros(*DOCS.shape, dtype=torch.long, device=DEVICE)
    layout = TokenLayout.of(ids, document_ids=None if docs is None else docs.to(DEVICE))
    q, k, v = (x.detach().to(DEVICE).requires_grad_() for x in qkv())
    out = attend(q, k, v, layout, mode, window=window, scale=D ** -0.5, softcap=softcap)
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = reference_attention(q2, k2, v2, reference_mask(docs, window).to(DEVICE), D ** -0.5, softcap)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad.double())
    worst = (out.double() - ref).abs().max().item()
    for mine, theirs in ((q, q2), (k, k2), (v, v2)):
        worst = max(worst, (mine.grad.double() - theirs.grad).abs().max().item())
    print(f"{mode} {case} on {DEVICE}: max abs diff (output and q/k/v grads) {worst:.2e}")
    return worst


@needs_cuda
@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_trains_as_the_reference(case, monkeypatch):
    docs, window, softcap = CASES[case]
    assert flex_unavailable("cuda") is None, f"compiled flex cannot run here: {flex_unavailable('cuda')}"
    chosen = choose_kernel("auto", "cuda", masked=docs is not None or window is not None,
                           softcap=softcap is not None, dropout=False)
    assert chosen == expected_kernel(case)
    calls = []
    real_flex = attention_module._flex
    monkeypatch.setattr(attention_module, "_flex", lambda *a, **k: calls.append(1) or real_flex(*a, **k))
    worst = measure("max abs diff vs float64 (output, q/k/v grads)", _compare("auto", case), 1e-4)
    assert len(calls) == (1 if chosen == "flex" else 0)  # auto ran the kernel it chose
    assert worst < 1e-4


@pytest.mark.parametrize("case", ["causal", "documents_and_window"])
def test_sdpa_trains_as_the_reference(case):
    assert measure("max abs diff vs float64 (output, q/k/v grads)", _compare("sdpa", case), 1e-4) < 1e-4


@needs_cuda
def test_megatron_fusions_equal_the_unfused_ops():
    """megatron's SwiGLU and bias-dropout-add (torch.compile, on with megatron.fused_kernels) vs plain ops."""
    import torch.nn.functional as F
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(64, 2, 512, device="cuda", generator=g, requires_grad=True)
    fused = bias_swiglu_impl(x, None, False)
    x2 = x.detach().clone().requires_grad_()
    gate, up = x2.chunk(2, dim=-1)
    plain = F.silu(gate) * up
    fused.sum().backward()
    plain.sum().backward()
    swiglu = max((fused - plain).abs().max().item(), (x.grad - x2.grad).abs().max().item())
    out, bias, residual = (torch.randn(64, 2, 256, device="cuda", generator=g) for _ in range(3))
    bda = (get_bias_dropout_add(True, True)((out, bias), residual, 0.0) - (residual + (out + bias))).abs().max().item()
    measure("swiglu fused vs unfused, max abs (output and grad)", swiglu, 1e-5)
    measure("bias-dropout-add fused vs unfused, max abs", bda, 1e-6)
    assert swiglu < 1e-5 and bda < 1e-6

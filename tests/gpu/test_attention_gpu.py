"""The toolkit's core attention and the megatron fusions it turns on, on the GPU (``pytest -m gpu``).

What the CPU suite cannot show: flex_attention training (torch has no CPU backward for it), the
compiled flex kernel with block masks and a softcap score_mod, sdpa's GPU kernels with GQA, and
megatron's torch-compiled SwiGLU and bias-dropout-add against the unfused ops. fp32 with TF32 off;
references in float64 (tests/test_attention.py). ``TOOLKIT_GPU_TESTS_ON_CPU=1`` runs the sdpa case.
"""
from __future__ import annotations

import os

import pytest
import torch

from tests.test_attention import CASES, D, DOCS, qkv, reference_attention, reference_mask
from toolkit.adapters.megatron.attention import TokenLayout, attend, choose_kernel

REHEARSAL = not torch.cuda.is_available() and os.environ.get("TOOLKIT_GPU_TESTS_ON_CPU") == "1"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (torch.cuda.is_available() or REHEARSAL),
                                 reason="needs a GPU (or TOOLKIT_GPU_TESTS_ON_CPU=1 to rehearse on the CPU)")]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="CUDA only (flex_attention has no CPU backward; the fusions are GPU-only)")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def strict_fp32():
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


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
def test_flex_trains_as_the_reference(case):
    assert choose_kernel("auto", "cuda", masked=CASES[case][0] is not None or CASES[case][1] is not None,
                         softcap=CASES[case][2] is not None, dropout=False) in ("flex", "sdpa")
    assert _compare("flex", case) < 1e-4


@pytest.mark.parametrize("case", ["causal", "documents_and_window"])
def test_sdpa_trains_as_the_reference(case):
    assert _compare("sdpa", case) < 1e-4


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
    print(f"fused vs unfused max abs diff: swiglu (output and grad) {swiglu:.2e}, bias-dropout-add {bda:.2e}")
    assert swiglu < 1e-5 and bda < 1e-6

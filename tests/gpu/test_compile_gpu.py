"""torch.compile on the device (``pytest -m gpu``; the GPU check's ``tests_layer``): what the toolkit
compiles (flex_attention, megatron's fusions) needs Triton, a C compiler and Python's headers there.
A slow first compile is only slow: these were preflight checks that could abort the whole GPU run
(four cold compiles over 150 s did); here each is one test among the rest.
``TOOLKIT_GPU_TESTS_ON_CPU=1`` rehearses them on the CPU (flex forward only: no CPU backward)."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.gpu import DEVICE, GPU_ONLY
from tests.helpers.measure import measure

pytestmark = [*GPU_ONLY, pytest.mark.usefixtures("strict_fp32")]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def test_compile_probe_torch_compile_forward_backward_equals_eager():
    x = torch.randn(64, 64, device=DEVICE, requires_grad=True)

    def f(t):
        return (torch.sin(t) * t).sum()
    (compiled,) = torch.autograd.grad(torch.compile(f)(x), x)
    x2 = x.detach().clone().requires_grad_()
    (eager,) = torch.autograd.grad(f(x2), x2)
    assert measure("grad rel to eager", _rel(compiled, eager), 1e-5) < 1e-5


def test_compile_probe_the_toolkit_finds_compile_working():
    """The toolkit's own probe (``adapters/compiled.compile_failure``), which decides its fallbacks
    (sdpa or math for flex, megatron's fusions off): none needed here."""
    from toolkit.adapters.compiled import compile_failure
    why = compile_failure(DEVICE)
    assert why is None, why


@pytest.mark.parametrize("strict", [False, True], ids=["plain", "strict_mode"])
def test_compile_probe_flex_documents_equal_sdpa(strict):
    """The toolkit's document attention through compiled flex_attention against sdpa with the same
    boolean mask, forward and (on a GPU) backward; also inside the strict device mode (a torch-function
    mode around ``torch.compile(flex_attention)`` made dynamo fail)."""
    from toolkit import device as tk_device
    from toolkit.adapters.attention import TokenLayout, attend
    g = torch.Generator().manual_seed(0)
    b, h, s, d = 2, 4, 256, 32
    backward = DEVICE == "cuda"
    q, k, v = (torch.randn(b, h, s, d, generator=g).to(DEVICE).requires_grad_(backward) for _ in range(3))
    docs = torch.cat([torch.zeros(b, s // 3), torch.ones(b, s - s // 3)], dim=1).long().to(DEVICE)
    layout = TokenLayout.of(torch.zeros(b, s, dtype=torch.long, device=DEVICE), document_ids=docs)
    if strict:
        tk_device.enable_strict()
    try:
        with torch.set_grad_enabled(backward):
            out = attend(q, k, v, layout, "flex", scale=d ** -0.5)
    finally:
        if strict:
            tk_device.disable_strict()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = torch.nn.functional.scaled_dot_product_attention(q2, k2, v2, attn_mask=layout.allowed(None), scale=d ** -0.5)
    err = _rel(out, ref)
    if backward:
        grad = torch.randn_like(out)
        out.backward(grad)
        ref.backward(grad)
        err = max([err] + [_rel(a.grad, c.grad) for a, c in ((q, q2), (k, k2), (v, v2))])
    assert measure("flex vs sdpa rel (output" + (", q/k/v grads)" if backward else ")"), err, 1e-4) < 1e-4

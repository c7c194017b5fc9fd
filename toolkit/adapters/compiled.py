"""torch.compile on this machine: whether it works, probed once per process and device type.

The toolkit's compiled kernels (flex_attention for documents, sliding windows and logit softcaps;
megatron's fused bias-dropout-add and SwiGLU) are built by torch.compile, which on a GPU generates
Triton kernels: that needs a C compiler and Python's headers on the machine, and without them fails
at the first call, mid-run. ``compile_failure`` compiles a tiny function once instead; where it
fails, the callers fall back (attention: sdpa with a boolean mask, or the math path where a logit
softcap needs it; megatron's fused kernels: off) and one line says so.

``TOOLKIT_COMPILE=0`` makes the probe fail without trying (a machine where Triton misbehaves; a
rehearsal of the fallbacks).
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch

COMPILE_ENV = "TOOLKIT_COMPILE"
FALLBACK = ("attention falls back to sdpa with a boolean mask (the math path with a logit softcap) and "
            "megatron's fused kernels are off")


@lru_cache(maxsize=None)
def compile_failure(device_type: str) -> str | None:
    """Why ``torch.compile`` cannot run a tiny function on ``device_type`` here, or None when it
    can. Probed once per process and device type; a failure is printed once, with the fallback."""
    reason = _probe(device_type)
    if reason is not None:
        print(f"torch.compile does not work on {device_type} here ({reason}): {FALLBACK}. Triton needs a C "
              "compiler and Python headers (e.g. apt-get install gcc python3-dev)", flush=True)
    return reason


def compile_works(device_type: str) -> bool:
    return compile_failure(device_type) is None


def _probe(device_type: str) -> str | None:
    if os.environ.get(COMPILE_ENV, "") == "0":
        return f"{COMPILE_ENV}=0"
    try:
        x = torch.linspace(-1, 1, 16, device=device_type)
        got = torch.compile(_tiny, dynamic=False, fullgraph=True)(x)
    except Exception as exc:  # noqa: BLE001 - any failure to build or run means: no compiled kernels
        lines = str(exc).strip().splitlines()
        return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"
    if not torch.allclose(got, _tiny(x)):
        return "the compiled probe computed a wrong result"
    return None


def _tiny(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x) * 2 + x

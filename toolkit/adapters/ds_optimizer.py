"""DeepSpeed's Adam where its kernel loads, torch's AdamW where it does not.

A DeepSpeed JSON with ``"optimizer": {"type": "AdamW"}`` (every shipped preset) makes DeepSpeed build
an op at first use: FusedAdam (on a GPU a JIT build with nvcc, ninja and Python's headers, which
DeepSpeed 0.19.8 refuses when nvcc's CUDA version differs from torch's unless
``DS_SKIP_CUDA_CHECK=1``), or DeepSpeedCPUAdam under optimizer offload (a C++ build). A machine
without that toolchain would crash in ``deepspeed.initialize``. Here the op is loaded first; when
it does not load on some rank, every rank runs DeepSpeed's own ``torch_adam`` path instead: torch's
AdamW with the same hyperparameters (fused where torch has a fused kernel for the device, else
foreach). The choice is printed once and recorded in metrics.jsonl (``{"event": "optimizer"}``).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
import torch.distributed as dist

from toolkit import device

KERNELS = {False: ("FusedAdamBuilder", "FusedAdam"), True: ("CPUAdamBuilder", "DeepSpeedCPUAdam")}
"""Optimizer offloaded? -> (DeepSpeed op builder, the optimizer class it serves)."""


@dataclass(frozen=True)
class OptimizerChoice:
    optimizer: str
    """What steps the parameters: ``FusedAdam``, ``DeepSpeedCPUAdam``, ``torch.optim.AdamW(fused=True)``..."""
    fallback_reason: str | None = None
    """Why DeepSpeed's kernel was not used (None: it was, or the JSON chose the optimizer)."""

    def record(self) -> dict:
        return {"event": "optimizer", "optimizer": self.optimizer, "fallback_reason": self.fallback_reason}

    def line(self) -> str:
        if self.fallback_reason is None:
            return f"toolkit: optimizer {self.optimizer}"
        return f"toolkit: optimizer {self.optimizer} with the same hyperparameters ({self.fallback_reason})"


def with_available_adam(ds_config: dict) -> tuple[dict, OptimizerChoice]:
    """``ds_config`` as DeepSpeed can run it on this machine, and what will step the parameters.
    Collective: every rank makes the same choice."""
    section = ds_config.get("optimizer") or {}
    kind, params = str(section.get("type", "")), section.get("params") or {}
    if kind.lower() not in ("adam", "adamw"):
        return ds_config, OptimizerChoice(f"{kind or 'none'} (as the DeepSpeed JSON says)")
    if params.get("torch_adam"):
        return ds_config, OptimizerChoice("torch.optim.AdamW (torch_adam in the DeepSpeed JSON)")
    offloaded = ((ds_config.get("zero_optimization") or {}).get("offload_optimizer") or {}).get("device") == "cpu"
    builder, kernel = KERNELS[offloaded]
    error = _agreed(_load_error(builder))
    if error is None:
        return ds_config, OptimizerChoice(kernel)
    impl = "fused" if _has_fused_adamw("cpu" if offloaded else device.rank_device().type) else "foreach"
    resolved = copy.deepcopy(ds_config)
    resolved["optimizer"].setdefault("params", {}).update({"torch_adam": True, impl: True})
    return resolved, OptimizerChoice(f"torch.optim.AdamW({impl}=True)", f"DeepSpeed's {kernel} did not load: {error}")


def _load_error(builder: str) -> str | None:
    """None when DeepSpeed's op loads (built now, or cached); else why not, in one line."""
    from deepspeed.ops import op_builder
    try:
        getattr(op_builder, builder)().load()
    except Exception as exc:  # a failed build raises many kinds (CalledProcessError, RuntimeError, ...)
        text = " ".join(str(exc).split())
        return f"{type(exc).__name__}: {text[:300]}"
    return None


def _agreed(error: str | None) -> str | None:
    """Every rank falls back when any rank's op failed (ranks must step alike)."""
    failed = device.zeros(1, dtype=torch.int32)
    failed += error is not None
    dist.all_reduce(failed, op=dist.ReduceOp.MAX)
    if failed.item() and error is None:
        return "it did not load on another rank"
    return error


def _has_fused_adamw(device_type: str) -> bool:
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    return device_type in _get_fused_kernels_supported_devices()

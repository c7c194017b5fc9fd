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


# --- exact resume with DeepSpeed's CPU Adam kernels ---------------------------------------------

def replay_cpu_adam_step_counter(optimizer) -> int:
    """Bring the C++ CPU Adam kernel's hidden step state to where an uninterrupted run has it.

    DeepSpeed's CPU Adam (FusedAdam on the CPU accelerator, and DeepSpeedCPUAdam under ZeRO-Offload
    on any machine) keeps ``beta^t`` inside the C++ optimizer object, not in the checkpoint. An
    uninterrupted run builds it as a running float product (``beta_t *= beta`` each step); a
    process that starts at step k+1 computes ``pow(beta, k+1)`` instead, which rounds differently,
    so every resumed update differed by ~1e-8 relative. Driving the kernel through steps 1..k on
    empty tensors rebuilds the same product, and the resumed run matches bit for bit.
    Returns the number of steps replayed (0 when the optimizer is not a CPU Adam kernel).
    """
    update = _cpu_adam_update_fn(optimizer)
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    if update is None or not steps:
        return 0
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    empty = torch.empty(0, dtype=torch.float32)
    for step in range(1, max(steps) + 1):
        update(step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
               bool(group["bias_correction"]), empty)
    return max(steps)


def _cpu_adam_update_fn(optimizer):
    """A call that runs one kernel step on given tensors, or None where the kernel keeps no state."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    if isinstance(optimizer, DeepSpeedCPUAdam):
        def update(step, lr, b1, b2, eps, wd, bias_correction, t):
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, lr, b1, b2, eps, wd, bias_correction,
                                              t, t, t, t)
        return update
    if isinstance(optimizer, FusedAdam) and get_accelerator().device_name() == "cpu":
        def update(step, lr, b1, b2, eps, wd, bias_correction, t):
            optimizer.multi_tensor_adam(2048 * 32, optimizer._dummy_overflow_buf, [[t], [t], [t], [t]],
                                        lr, b1, b2, eps, step, optimizer.adam_w_mode, int(bias_correction), wd)
        return update
    return None  # CUDA FusedAdam and torch's Adam derive beta^t from the step on every call

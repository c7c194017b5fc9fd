"""Scoped compatibility layer that lets megatron-core run on CPU with gloo.

megatron-core assumes a CUDA device: it allocates with ``device=torch.cuda.current_device()`` or
``device="cuda"``, forks the CUDA RNG for TP-region init and dropout, synchronizes, and checks
``param.type() == "torch.cuda.FloatTensor"`` in its optimizers. While this layer is enabled the
CPU plays the CUDA device's role:

=====================================================  ==========================================
megatron-core does                                     while enabled
=====================================================  ==========================================
``device="cuda"`` / ``device=<int>`` / ``.to("cuda")``  the device becomes ``cpu`` (a
                                                       ``TorchFunctionMode`` rewrites the argument)
``torch.cuda.current_device()``                        0 (which the mode then maps to ``cpu``)
``tensor.cuda()``                                      the tensor itself
``torch.cuda.{get,set}_rng_state``, ``manual_seed``    the CPU default generator (so megatron's RNG
and megatron's ``_{get,set}_cuda_rng_state``           tracker forks the generator CPU ops use)
``torch.cuda.synchronize()``                           no-op
the backward of megatron's tensor-parallel autograd     runs inside the mode too (autograd does not
functions (activation recomputation, the sequence-     carry torch-function modes into backward)
parallel all-gather of linear layers, ...)
``cpu_float_tensor.type()`` (no argument)              ``"torch.cuda.FloatTensor"`` (and Half/BFloat16)
=====================================================  ==========================================

Also set ``TransformerConfig(use_cpu_initialization=True)``: see ``TRANSFORMER_CONFIG``.

Use ``with cpu_compat():`` or ``enable()`` / ``disable()``. Enabling is reference counted and
idempotent; disabling the last reference restores every patched attribute. On a machine with a GPU
``enable`` does nothing, so callers need no branch. Only ``adapters/megatron.py`` imports this.
"""
from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

TRANSFORMER_CONFIG = {"use_cpu_initialization": True}
"""TransformerConfig fields the CPU needs (weights are initialized on the CPU, then moved)."""

_CUDA_TYPE_NAMES = {"torch.FloatTensor": "torch.cuda.FloatTensor", "torch.HalfTensor": "torch.cuda.HalfTensor",
                    "torch.BFloat16Tensor": "torch.cuda.BFloat16Tensor"}
_DEVICE_METHODS = {torch.Tensor.to, torch.Tensor.new_empty, torch.Tensor.new_zeros, torch.Tensor.new_ones,
                   torch.Tensor.new_full, torch.Tensor.new_tensor}

_lock = threading.Lock()
_state: dict = {"depth": 0, "saved": [], "mode": None}


def needed() -> bool:
    """True when no GPU is present: the only situation in which this layer does anything."""
    return not torch.cuda.is_available()


def is_enabled() -> bool:
    return _state["depth"] > 0 and _state["mode"] is not None


def _is_cuda(device) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA ordinal in torch's device arguments
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


class _CudaToCpu(TorchFunctionMode):
    """Rewrites CUDA ``device`` arguments of any torch call to ``cpu``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _cuda_type(self, dtype=None, non_blocking=False, **kwargs):
    if dtype is None and not kwargs:
        name = _ORIGINAL_TYPE(self)
        return _CUDA_TYPE_NAMES.get(name, name)
    return _ORIGINAL_TYPE(self, dtype, non_blocking, **kwargs)


_ORIGINAL_TYPE = torch.Tensor.type


def _patches() -> list[tuple[object, str, object]]:
    """(owner, attribute, stand-in) for everything the layer replaces."""
    from megatron.core.tensor_parallel import random as mcore_random

    def get_rng_state(device="cuda", clone=False, graph_safe=False):
        return torch.get_rng_state()

    def set_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    return [
        *((fn, "backward", _backward_in_mode(fn.backward)) for fn in _megatron_autograd_functions()),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "synchronize", lambda device=None: None),
        (torch.cuda, "get_rng_state", get_rng_state),
        (torch.cuda, "set_rng_state", set_rng_state),
        (torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed))),
        (torch.Tensor, "cuda", lambda self, device=None, non_blocking=False, **kw: self),
        (torch.Tensor, "type", _cuda_type),
        (mcore_random, "_get_cuda_rng_state", get_rng_state),
        (mcore_random, "_set_cuda_rng_state", set_rng_state),
    ]


def _megatron_autograd_functions() -> list[type]:
    """megatron's tensor-parallel ``torch.autograd.Function`` classes that define a backward."""
    from megatron.core.tensor_parallel import layers, mappings, random
    return [obj for module in (layers, mappings, random) for obj in vars(module).values()
            if isinstance(obj, type) and issubclass(obj, torch.autograd.Function)
            and obj.__module__ == module.__name__ and "backward" in obj.__dict__]


def _backward_in_mode(backward):
    # The autograd engine does not carry Python torch-function modes into backward, where megatron
    # allocates on torch.cuda.current_device() (sequence-parallel all-gathers, recomputed forwards).
    def in_mode(ctx, *grads):
        with _CudaToCpu():
            return backward(ctx, *grads)
    return staticmethod(in_mode)


def enable() -> bool:
    """Apply the layer (no-op with a GPU); returns whether it is active. Idempotent, counted."""
    if not needed():
        return False
    with _lock:
        _state["depth"] += 1
        if _state["depth"] > 1:
            return True
        for owner, name, stand_in in _patches():
            _state["saved"].append((owner, name, owner.__dict__.get(name, _MISSING), getattr(owner, name, _MISSING)))
            setattr(owner, name, stand_in)
        mode = _CudaToCpu()
        mode.__enter__()
        _state["mode"] = mode
    return True


def disable() -> None:
    """Undo one ``enable``; the last one restores every original attribute and leaves the mode."""
    with _lock:
        if _state["depth"] == 0:
            return
        _state["depth"] -= 1
        if _state["depth"] > 0:
            return
        mode, _state["mode"] = _state["mode"], None
        if mode is not None:
            mode.__exit__(None, None, None)
        for owner, name, own, original in reversed(_state["saved"]):
            if own is _MISSING:
                delattr(owner, name)  # it was inherited, lazily resolved or absent: drop our override
                if original is not _MISSING and getattr(owner, name, None) is not original:
                    setattr(owner, name, original)
            else:
                setattr(owner, name, own)
        _state["saved"].clear()


_MISSING = object()


@contextlib.contextmanager
def cpu_compat():
    """``with cpu_compat():`` megatron-core runs on CPU inside the block (nothing happens on GPU)."""
    enable()
    try:
        yield
    finally:
        disable()

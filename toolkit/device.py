"""Where tensors live: the rank's device, the one host -> device hand-off, GPU-honest timers, and a
strict mode in which a CPU run catches the device mistakes a GPU run would die of.

On a GPU every tensor a collective (NCCL) or the model sees must be on the rank's CUDA device. On a
CPU machine host and device are the same memory, so a tensor left on the host passes unnoticed,
and megatron's CPU layer (``compat/megatron_cpu.py``) hides more. Strict mode
(``TOOLKIT_STRICT_DEVICES=1``; the test suite turns it on for every job) tells them apart by origin:

- a *host tensor* is one the data pipeline built (``host_batch``), or one that toolkit code made
  with a factory call (``torch.zeros``, ``torch.tensor``, ``torch.arange``, ...) without a
  ``device=`` argument, or computed in toolkit code from a host tensor;
- ``to_device`` (the one hand-off) returns new, unmarked tensors, as a copy to the GPU would;
- every ``torch.distributed`` collective, a guarded module's forward (``guard_inputs``) and the loss
  functions (``require_on_device``) refuse a host tensor, naming where it was made.

Strict mode tracks only the main thread's toolkit code (torch-function modes are per thread); the
data pipeline's prefetch thread marks its batches itself. It steps aside while dynamo traces
(``torch.compile``: compiled flex_attention, megatron's fused kernels), so compiled code runs as it
would without it; what goes into and comes out of compiled code is still checked where it is used.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.autograd.graph import save_on_cpu
from torch.overrides import TorchFunctionMode

STRICT_ENV = "TOOLKIT_STRICT_DEVICES"
_HOST_ORIGIN = "_toolkit_host_origin"  # attribute on a host tensor: where it was made
_EXEMPT = ("toolkit.device", "toolkit.compat")  # the hand-off itself; the CPU stand-ins for CUDA


class DeviceError(RuntimeError):
    """A tensor on the host where the rank's device is required (strict mode)."""


_CPU_RANK_DEVICE = torch.device("cpu")
"""One object: strict mode tells a move to the rank's device (this object) from one to the host
(any other CPU device), though on a CPU machine both are the CPU."""


def rank_device() -> torch.device:
    """This rank's compute device: ``cuda:<current>`` with a GPU (``parallel.init_process_group``
    sets it from LOCAL_RANK), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return _CPU_RANK_DEVICE


def tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """``values`` as a tensor on the rank's device (for collectives on Python numbers)."""
    return torch.tensor(values, dtype=dtype, device=rank_device())


def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(*shape, dtype=dtype, device=rank_device())


def to_device(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The one host -> device hand-off of a micro-batch (non-blocking from pinned memory on GPUs).
    In strict mode on the CPU, a copy, as the GPU copy would be."""
    device, copy = rank_device(), _strict["on"] and not torch.cuda.is_available()
    return {k: v.to(device, non_blocking=True, copy=copy) for k, v in batch.items()}


def host_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The data pipeline's micro-batch on the host: pinned when a GPU will receive it (so
    ``to_device`` copies asynchronously), marked as host memory in strict mode."""
    if torch.cuda.is_available():
        batch = {k: v.pin_memory() for k, v in batch.items()}
    if _strict["on"]:
        for v in batch.values():
            _mark(v, "the data pipeline (toolkit.data)")
    return batch


def synchronize() -> None:
    """Wait for this rank's queued GPU work (no-op on the CPU): timers read after it measure work,
    not kernel launches."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def use_tf32(enabled: bool) -> None:
    """fp32 matmuls on NVIDIA tensor cores in TF32 (Ampere and newer; what ``toolkit.estimate.flops`` assumes
    for an fp32 run's peak), or strict IEEE fp32. Nothing changes on the CPU."""
    if torch.cuda.is_available():
        torch.set_float32_matmul_precision("high" if enabled else "highest")


def host_checkpoint(function, *args, **kwargs):
    """torch's non-reentrant activation checkpoint whose saved inputs (an HF decoder layer's hidden
    states, [b, s, h]) torch's ``save_on_cpu`` keeps in host memory until the backward's recompute
    brings them back (``zero.offload_activations``). transformers 5.24's own
    ``activation_checkpointing_enable(offload=True)`` is this with host memory always pinned, which
    raises on a machine without an accelerator; here it is pinned only when a GPU copies to it (on
    the CPU the "copy" is the tensor itself, so the hooks run and nothing moves)."""
    from torch.utils.checkpoint import checkpoint
    with save_on_cpu(pin_memory=torch.cuda.is_available()):
        return checkpoint(function, *args, use_reentrant=False, **kwargs)


class Stopwatch:
    """Accumulated time of code regions on this rank's device. On a GPU, CUDA events around each
    region (no synchronization while running; ``seconds`` waits for the last one); on the CPU,
    the wall clock."""

    def __init__(self):
        self._cuda = torch.cuda.is_available()
        self._pairs: list = []
        self._wall = 0.0
        self._start = None

    def start(self) -> None:
        if self._cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pairs.append((self._start, end))
        else:
            self._wall += time.perf_counter() - self._start

    def seconds(self) -> float:
        if self._cuda:
            if self._pairs:
                self._pairs[-1][1].synchronize()
            return sum(a.elapsed_time(b) for a, b in self._pairs) / 1000.0
        return self._wall


# --- strict mode ------------------------------------------------------------------------------------

_strict: dict = {"on": False, "mode": None, "originals": {}}

_FACTORIES = frozenset({torch.tensor, torch.zeros, torch.ones, torch.empty, torch.full, torch.arange,
                        torch.as_tensor, torch.rand, torch.randn, torch.randint, torch.linspace, torch.eye})
_PLACEMENTS = frozenset({torch.Tensor.to, torch.Tensor.cuda, torch.Tensor.cpu})
# Point-to-point ops are left alone: torch's P2POp accepts only its own isend/irecv objects, and
# toolkit code sends nothing point to point (megatron's pipeline does, on its own buffers).
COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
               "reduce_scatter_tensor", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single")


def strict_requested() -> bool:
    return os.environ.get(STRICT_ENV, "") not in ("", "0")


def enable_strict() -> None:
    """Track host tensors made by toolkit code on this thread and check every collective. Idempotent."""
    if _strict["on"]:
        return
    _strict["on"] = True
    for name in COLLECTIVES:
        original = getattr(dist, name)
        _strict["originals"][name] = original
        setattr(dist, name, _checked_collective(name, original))
    mode = _HostTracker()
    mode.__enter__()
    _strict["mode"] = mode


def disable_strict() -> None:
    if not _strict["on"]:
        return
    _strict["mode"].__exit__(None, None, None)
    for name, original in _strict["originals"].items():
        setattr(dist, name, original)
    _strict.update(on=False, mode=None, originals={})


def host_origin(t) -> str | None:
    """Where a host tensor was made (strict mode), or None."""
    return getattr(t, _HOST_ORIGIN, None) if isinstance(t, torch.Tensor) else None


def require_on_device(t: torch.Tensor, what: str) -> None:
    """Strict mode: refuse a host tensor where the device is required (e.g. labels in a loss)."""
    origin = host_origin(t)
    if origin is not None:
        raise DeviceError(f"{what} is a host tensor (made at {origin}); on a GPU this fails. "
                          "Move it with toolkit.device.to_device or create it with device=rank_device()")


def guard_inputs(module: torch.nn.Module, name: str) -> None:
    """Strict mode: ``module``'s forward refuses host tensors among its inputs."""
    if not _strict["on"]:
        return

    def check(mod, args, kwargs):
        for i, value in enumerate([*args, *kwargs.values()]):
            require_on_device(value, f"input {i} of {name}.forward")

    module.register_forward_pre_hook(check, with_kwargs=True)


def _mark(t: torch.Tensor, origin: str) -> None:
    try:
        setattr(t, _HOST_ORIGIN, origin)
    except (AttributeError, RuntimeError):
        pass  # a tensor type without attributes: left unchecked


def toolkit_caller(depth: int = 2) -> str | None:
    """``file:line`` of the code that called torch, when it is toolkit code (outside the exempt
    modules). Torch's own Python frames (``F.pad``, ``Tensor.split``) and other torch-function
    modes (megatron's CPU layer stacks one above this) are looked through."""
    frame = sys._getframe(depth)
    while frame is not None and (frame.f_code.co_name == "__torch_function__"
                                 or frame.f_globals.get("__name__", "").startswith("torch.")):
        frame = frame.f_back
    if frame is None:
        return None
    module = frame.f_globals.get("__name__", "")
    if not module.startswith("toolkit.") or module.startswith(_EXEMPT):
        return None
    return f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"


def tensors_in(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from (x for x in v if isinstance(x, torch.Tensor))


def _placement(func, args, kwargs):
    """Where an explicit placement sends a tensor: "host", "device", or None (no device named:
    ``.to(dtype)``)."""
    if func is torch.Tensor.cpu:
        return "host"
    if func is torch.Tensor.cuda:
        return "device"
    target = kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, torch.device))), None))
    if target is None:
        return None
    return "host" if target is not _CPU_RANK_DEVICE and torch.device(target).type == "cpu" else "device"


class _HostTracker(TorchFunctionMode):
    """Marks what toolkit code makes on the host: factory calls without ``device=``, explicit moves
    to the CPU (``.cpu()``, ``.to("cpu")``), and results computed from host tensors; an explicit
    move to the device unmarks. (``torch.from_numpy`` passes no torch-function mode: the data
    pipeline marks its batches itself.)"""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            # dynamo traces this method into every graph it compiles under the mode: stepping aside
            # keeps the graph the one it would be without strict mode (the tracking below graph-breaks
            # on sys._getframe, and breaks dynamo's flex_attention). Compiled code is checked where it
            # is called (toolkit.adapters.attention checks its inputs) and at the collectives.
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        outputs = list(tensors_in([out]))
        if not outputs:
            return out
        site = toolkit_caller()
        if site is None:
            return out
        if func in _FACTORIES:
            origin = site if kwargs.get("device") is None else None
        elif func in _PLACEMENTS and _placement(func, args, kwargs) is not None:
            origin = site if _placement(func, args, kwargs) == "host" else None
            if origin is None and host_origin(out) is not None:
                # On the CPU a move to the rank's device returns the same tensor: it was moved.
                delattr(out, _HOST_ORIGIN)
        elif func is torch.Tensor.copy_:  # a copy into a tensor keeps where that tensor lives
            return out
        else:
            origin = next((host_origin(t) for t in tensors_in([*args, *kwargs.values()]) if host_origin(t)), None)
        if origin is not None:
            for t in outputs:
                _mark(t, origin)
        return out


def _checked_collective(name: str, original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def collective(*args, **kwargs):
        for t in tensors_in([*args, *kwargs.values()]):
            origin = host_origin(t)
            if origin is not None:
                raise DeviceError(
                    f"torch.distributed.{name} of a host tensor made at {origin}; under NCCL this fails "
                    "('No backend type associated with device type cpu'). Create it with "
                    "device=toolkit.device.rank_device() or move it with toolkit.device.to_device")
        _refuse_non_contiguous(name, signature, args, kwargs)
        return original(*args, **kwargs)
    return collective


# NCCL's rules that gloo forgives ---------------------------------------------------------------------

NCCL_RAW_ARGUMENTS = {
    "all_reduce": ("tensor",), "broadcast": ("tensor",), "reduce": ("tensor",),
    "all_gather": ("tensor",), "all_gather_into_tensor": ("output_tensor", "input_tensor"),
    "reduce_scatter": ("output",), "reduce_scatter_tensor": ("output", "input"),
    "all_to_all_single": ("output", "input"), "all_to_all": ("output_tensor_list", "input_tensor_list"),
    "gather": ("tensor", "gather_list"), "scatter": ("tensor", "scatter_list"),
}
"""Per collective, the arguments (tensors, or lists of them) ProcessGroupNCCL hands NCCL as raw
memory, which must therefore be contiguous: it raises "Tensors must be contiguous" for most
(``check_gpu_single_tensor``) and reads the raw memory of the rest (reduce_scatter_tensor, the
all-to-alls, gather and scatter lists: a non-contiguous tensor there moves the wrong elements).
all_gather's output list and reduce_scatter's input list are copied through a flat buffer, so NCCL
takes them in any layout. gloo copies every argument: on the CPU only this check sees the mistake."""

_COMM_MODULES = ("torch.", "deepspeed.comm", "toolkit.device")
"""Pass-through frames between the code that asks for a collective and torch.distributed."""


def _refuse_non_contiguous(name: str, signature: inspect.Signature, args, kwargs) -> None:
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError:
        return  # torch itself will say what is wrong with the call
    for argument in NCCL_RAW_ARGUMENTS.get(name, ()):
        value = bound.get(argument)
        tensors = value if isinstance(value, (list, tuple)) else [value]
        for i, t in enumerate(tensors):
            if isinstance(t, torch.Tensor) and not _nccl_contiguous(t):
                where = argument + (f"[{i}]" if isinstance(value, (list, tuple)) else "")
                raise DeviceError(
                    f"torch.distributed.{name} of a non-contiguous tensor ({where}: shape {tuple(t.shape)}, stride "
                    f"{t.stride()}), called from {_comm_caller()}; ProcessGroupNCCL refuses it ('Tensors must be "
                    "contiguous') or reads its raw memory, where gloo copies it. Make it contiguous where it is "
                    "made (.contiguous()) before it reaches the collective")


def _nccl_contiguous(t: torch.Tensor) -> bool:
    """``t.is_contiguous(t.suggest_memory_format())``, as ProcessGroupNCCL asks: row-major, or
    channels-last for a channels-last tensor."""
    if t.is_contiguous():
        return True
    last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    return last is not None and t.is_contiguous(memory_format=last)


def _comm_caller() -> str:
    """The code that asked for the collective (the first frame outside torch, DeepSpeed's comm
    layer and this module), and the toolkit code on the way to it when that is not toolkit code."""
    frame, found = sys._getframe(2), []
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if not module.startswith(_COMM_MODULES):
            site = f"{frame.f_code.co_filename}:{frame.f_lineno} ({frame.f_code.co_name})"
            if not found:
                found.append(site.rsplit("site-packages/", 1)[-1])
            if module.startswith("toolkit."):
                if len(found) == 1 and not found[0].startswith(frame.f_code.co_filename):
                    found.append(f"reached from {site}")
                break
        frame = frame.f_back
    return ", ".join(found) or "?"


def strict_on() -> bool:
    """Whether strict mode is on in this process."""
    return _strict["on"]


def is_rank_device_object(where) -> bool:
    """``where`` is this rank's device object on a CPU machine (a move there is a move to the device)."""
    return where is _CPU_RANK_DEVICE

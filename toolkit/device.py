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

import contextlib
import functools
import os
import sys
import time
import weakref

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


def _toolkit_caller(depth: int = 2) -> str | None:
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


def _tensors(values):
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
        outputs = list(_tensors([out]))
        if not outputs:
            return out
        site = _toolkit_caller()
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
            origin = next((host_origin(t) for t in _tensors([*args, *kwargs.values()]) if host_origin(t)), None)
        if origin is not None:
            for t in outputs:
                _mark(t, origin)
        return out


def _checked_collective(name: str, original):
    @functools.wraps(original)
    def collective(*args, **kwargs):
        for t in _tensors([*args, *kwargs.values()]):
            origin = host_origin(t)
            if origin is not None:
                raise DeviceError(
                    f"torch.distributed.{name} of a host tensor made at {origin}; under NCCL this fails "
                    "('No backend type associated with device type cpu'). Create it with "
                    "device=toolkit.device.rank_device() or move it with toolkit.device.to_device")
        return original(*args, **kwargs)
    return collective


# --- host syncs ---------------------------------------------------------------------------------------

# Calls after which the host holds a value computed on the device, so it waits for every queued
# kernel: a read of values, or an output whose size depends on them (nonzero and its kin).
_READS = frozenset({torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__float__,
                    torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__complex__, torch.Tensor.__format__,
                    torch.Tensor.numpy, torch.equal, torch.allclose, torch.is_nonzero, torch.Tensor.is_nonzero})
_DATA_SIZED = frozenset({torch.nonzero, torch.Tensor.nonzero, torch.argwhere, torch.Tensor.argwhere,
                         torch.masked_select, torch.Tensor.masked_select, torch.unique, torch.Tensor.unique,
                         torch.unique_consecutive, torch.Tensor.unique_consecutive, torch.bincount,
                         torch.Tensor.bincount})
_INDEXING = frozenset({torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_,
                       torch.Tensor.index_put, torch.index_put})


# Library code whose tensors live on the host on any machine, which the CPU cannot tell apart:
# megatron's RNG tracker compares CPU generator states (torch.get_rng_state) around each fork.
_HOST_ONLY_SITES = ("megatron/core/tensor_parallel/random.py",)


class SyncCounter(TorchFunctionMode):
    """Counts, by call site, the calls that make the host wait for the device (a device-to-host
    sync on a GPU): reading a value (``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``,
    ``torch.equal``), an output sized by the data (``nonzero``, ``masked_select``, ``unique``,
    ``bincount``, ``repeat_interleave`` without ``output_size``, indexing with a boolean tensor), a
    device tensor copied to the host (``.cpu()``; ``.to("cpu")`` in toolkit code), and a tensor made
    from Python numbers on the device (``torch.tensor(x, device=...)``: a blocking copy that waits
    for the stream). Any caller counts: toolkit code, megatron, DeepSpeed; not torch's optimizers,
    whose step counts live on the host.

    On a GPU a host tensor is a CPU tensor. On the CPU it is one strict mode marked as made on the
    host, or one this counter saw copied there (or computed from one); the counter keeps its own
    record of those, so strict mode's checks are unchanged. A mode sees only the outermost torch
    call (not what a torch function calls inside itself); compiled regions are not counted.

    ``with count_syncs() as syncs: ...``; then ``syncs.total`` and ``syncs.sites``."""

    def __init__(self):
        super().__init__()
        self.sites: dict[str, int] = {}
        self._host: dict[int, weakref.ref] = {}  # CPU machine: tensors seen copied to the host, by id

    @property
    def total(self) -> int:
        return sum(self.sites.values())

    def on_device(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if torch.cuda.is_available():
            return t.device.type != "cpu"
        return host_origin(t) is None and not self._is_copy(t)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch.compiler.is_compiling():
            return func(*args, **kwargs)
        if not self._waits(func, args, kwargs) or _in_torch_optim():
            out = func(*args, **kwargs)
            if self._host and any(self._is_copy(t) for t in _tensors([*args, *kwargs.values()])):
                self._follow_host(func, args, kwargs, out)
            return out
        site = _outer_caller()
        if site.startswith(_HOST_ONLY_SITES):
            return func(*args, **kwargs)
        self.sites[site] = self.sites.get(site, 0) + 1
        out = func(*args, **kwargs)
        if func in (torch.Tensor.cpu, torch.Tensor.to) and not torch.cuda.is_available():
            if out is args[0]:  # the CPU's no-op move: a copy, as on a GPU, so the source stays a device tensor
                out = out.clone()
            self._add_copy(out)
        return out

    def _is_copy(self, t: torch.Tensor) -> bool:
        ref = self._host.get(id(t))
        return ref is not None and ref() is t

    def _add_copy(self, t: torch.Tensor) -> None:
        self._host[id(t)] = weakref.ref(t, lambda _, key=id(t): self._host.pop(key, None))

    def _follow_host(self, func, args, kwargs, out) -> None:
        """What is computed from a host copy stays on the host, unless moved to the device."""
        if _placed_on_device(func, args, kwargs):
            if func is not torch.Tensor.copy_ and self._is_copy(out):
                del self._host[id(out)]  # the CPU's no-op move returned the tensor itself
            return
        for t in _tensors([out]):
            self._add_copy(t)

    def _waits(self, func, args, kwargs) -> bool:
        if func in _READS or func in _DATA_SIZED:
            return any(self.on_device(t) for t in _tensors(args[:1]))
        if func in _INDEXING:
            return self.on_device(args[0]) and _mask_indexing_syncs(func, args, kwargs)
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):  # tensor repeats size the output
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0])
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        if func is torch.Tensor.cpu:
            return self.on_device(args[0])
        if func is torch.Tensor.to:  # on the CPU, libraries name their device "cpu": toolkit code only
            to_host = _names_host(args, kwargs) and (torch.cuda.is_available() or _toolkit_caller() is not None)
            return to_host and self.on_device(args[0])
        if func in (torch.tensor, torch.as_tensor):
            data, where = args[0] if args else kwargs.get("data"), kwargs.get("device")
            return not isinstance(data, torch.Tensor) and where is not None and not _is_host(where)
        return False


def count_syncs() -> SyncCounter:
    """A ``SyncCounter`` to enter around the code to count (this thread only)."""
    return SyncCounter()


def strict_sync_counter():
    """In strict mode, a ``SyncCounter`` for one training step (the trainer records its total as
    the step's ``host_syncs`` in metrics.jsonl); otherwise a context that counts nothing (None)."""
    return SyncCounter() if _strict["on"] else contextlib.nullcontext()


def _in_torch_optim() -> bool:
    """Called from torch's optimizers, which keep their step counts on the host (unless
    ``capturable`` or fused, then on the device): reading them waits for nothing."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_name == "__torch_function__"
                                 or frame.f_globals.get("__name__", "") in ("torch.overrides", "torch._tensor")):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith("torch.optim")


def _mask_indexing_syncs(func, args, kwargs) -> bool:
    """Indexing with a boolean mask sizes its output by the mask, except ``t[mask] = scalar`` and
    ``t[mask, :] = scalar`` (one mask, no other tensor index, a number or a one-element host tensor),
    which torch runs as ``masked_fill_`` (its canDispatchToMaskedFill)."""
    index = args[1] if len(args) > 1 else kwargs.get("indices")
    tensors = list(_tensors([index]))
    masks = [t for t in tensors if t.dtype in (torch.bool, torch.uint8)]
    if func is torch.Tensor.__getitem__ or not masks:
        return bool(masks)
    value = args[2] if len(args) > 2 else kwargs.get("values")
    scalar = not isinstance(value, torch.Tensor) or (value.numel() == 1 and value.device.type == "cpu")
    return not (len(tensors) == 1 and scalar)


def _device_argument(args, kwargs):
    return kwargs.get("device", next((a for a in args[1:] if isinstance(a, (str, int, torch.device))), None))


def _names_host(args, kwargs) -> bool:
    where = _device_argument(args, kwargs)
    return where is not None and _is_host(where)


def _placed_on_device(func, args, kwargs) -> bool:
    """A call whose result is on the device whatever its inputs: a move there, or a copy into a
    device tensor."""
    if func in (torch.Tensor.cuda, torch.Tensor.copy_):
        return True
    where = _device_argument(args, kwargs) if func is torch.Tensor.to else None
    return where is not None and not _is_host(where)


def _is_host(where) -> bool:
    """A host device argument: the CPU, except this rank's device object on a CPU machine."""
    if where is _CPU_RANK_DEVICE or isinstance(where, (int, bool)):
        return False
    return torch.device(where).type == "cpu"


def _outer_caller() -> str:
    """``file:line`` of the first frame outside torch (the code that asked for the sync)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_name == "__torch_function__"
                                 or frame.f_globals.get("__name__", "").startswith("torch.")):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{frame.f_code.co_filename.rsplit('site-packages/', 1)[-1]}:{frame.f_lineno}"

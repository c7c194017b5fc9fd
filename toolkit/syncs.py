"""Host syncs: the calls that make a GPU's host wait for the device, counted by call site
(``SyncCounter``). In strict device mode (``toolkit/device.py``) the trainer counts every step's
(``host_syncs`` in metrics.jsonl); tests bound them (``tests/distributed/test_host_syncs.py``).

On the CPU nothing waits: the counter tells which calls would, from strict mode's host marks (a
tensor made on the host) and its own record of tensors copied to the host."""
from __future__ import annotations

import contextlib
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode

from toolkit.device import host_origin, is_rank_device_object, strict_on, tensors_in, toolkit_caller

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
            if self._host and any(self._is_copy(t) for t in tensors_in([*args, *kwargs.values()])):
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
        for t in tensors_in([out]):
            self._add_copy(t)

    def _waits(self, func, args, kwargs) -> bool:
        if func in _READS or func in _DATA_SIZED:
            return any(self.on_device(t) for t in tensors_in(args[:1]))
        if func in _INDEXING:
            return self.on_device(args[0]) and _mask_indexing_syncs(func, args, kwargs)
        if func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):  # tensor repeats size the output
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0])
            return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
        if func is torch.Tensor.cpu:
            return self.on_device(args[0])
        if func is torch.Tensor.to:  # on the CPU, libraries name their device "cpu": toolkit code only
            to_host = _names_host(args, kwargs) and (torch.cuda.is_available() or toolkit_caller() is not None)
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
    return SyncCounter() if strict_on() else contextlib.nullcontext()


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
    tensors = list(tensors_in([index]))
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
    if is_rank_device_object(where) or isinstance(where, (int, bool)):
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

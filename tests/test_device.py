"""Strict device mode (toolkit/device.py): how a CPU run tells host tensors from device tensors.

The whole suite runs its ranks in strict mode (tests/conftest.py), so every job checks the real
code paths; these tests pin the mechanism itself: what is marked, what is refused, what passes.
Toolkit code is told apart by its module name, so the snippets below run as a module named
``toolkit._strict_probe``.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from toolkit import device


@pytest.fixture
def strict_group():
    """A one-rank gloo group in this process, with strict mode on; both undone afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    device.enable_strict()
    try:
        yield
    finally:
        device.disable_strict()
        dist.destroy_process_group()


def as_toolkit_code(source: str) -> dict:
    """Run ``source`` as if it were a toolkit module; its globals afterwards."""
    scope = {"__name__": "toolkit._strict_probe", "torch": torch, "dist": dist, "device": device}
    exec(compile(source, "toolkit/_strict_probe.py", "exec"), scope)
    return scope


def test_a_collective_of_a_tensor_made_without_device_is_refused(strict_group):
    with pytest.raises(device.DeviceError, match=r"all_reduce of a host tensor made at toolkit/_strict_probe.py:1"):
        as_toolkit_code("flag = torch.tensor([1])\ndist.all_reduce(flag)")


def test_derived_host_tensors_stay_host(strict_group):
    with pytest.raises(device.DeviceError, match="_strict_probe.py:1"):
        as_toolkit_code("totals = torch.zeros(2)\nboth = torch.stack([totals, totals]).double()\n"
                        "dist.all_reduce(both)")
    with pytest.raises(device.DeviceError):  # in place: the same (host) tensor
        as_toolkit_code("t = device.zeros(2, dtype=torch.float64)\nt += torch.ones(2)\ndist.all_reduce(t)")


def test_device_tensors_and_library_code_pass(strict_group):
    scope = as_toolkit_code(
        "a = device.zeros(2, dtype=torch.float64)\n"
        "b = device.tensor([1, 2], dtype=torch.int32)\n"
        "c = torch.arange(3, device=a.device)\n"
        "d = device.to_device({'x': torch.ones(2)})['x']\n"
        "for t in (a, b, c, d):\n    dist.all_reduce(t)\n")
    assert scope["b"].tolist() == [1, 2]
    dist.all_reduce(torch.tensor([1]))  # not toolkit code (this test module): not tracked


def test_batches_must_be_handed_to_the_device(strict_group):
    batch = device.host_batch({"input_ids": torch.ones(1, 4, dtype=torch.long)})
    model = torch.nn.Embedding(8, 4)
    device.guard_inputs(model, "the probe model")
    with pytest.raises(device.DeviceError, match="input 0 of the probe model.forward is a host tensor"):
        model(batch["input_ids"])
    placed = device.to_device(batch)
    assert device.host_origin(placed["input_ids"]) is None
    model(placed["input_ids"])
    with pytest.raises(device.DeviceError, match="labels is a host tensor"):
        device.require_on_device(batch["input_ids"], "labels")


def test_disable_restores_torch_distributed():
    originals = {name: getattr(dist, name) for name in device.COLLECTIVES}
    device.enable_strict()
    device.enable_strict()  # idempotent
    assert dist.all_reduce is not originals["all_reduce"]
    device.disable_strict()
    assert {name: getattr(dist, name) for name in device.COLLECTIVES} == originals
    assert device.host_origin(as_toolkit_code("t = torch.zeros(1)")["t"]) is None  # no tracking when off


def test_stopwatch_and_rank_device_on_cpu():
    watch = device.Stopwatch()
    for _ in range(2):
        watch.start()
        torch.ones(64, 64) @ torch.ones(64, 64)
        watch.stop()
    assert watch.seconds() > 0
    assert device.rank_device() == (torch.device("cuda", torch.cuda.current_device())
                                    if torch.cuda.is_available() else torch.device("cpu"))


def test_moves_to_the_host_dtype_casts_views_and_torch_functions_keep_the_mark(strict_group):
    """``.cpu()``, ``.to("cpu")``, ``.to(dtype)``, tuple results (``split``) and torch's Python-level
    functions (``F.pad``) called from toolkit code: all host tensors to a collective."""
    for line in ("t = device.zeros(2, dtype=torch.float32).cpu()",
                 "t = device.zeros(2, dtype=torch.float32).to('cpu')",
                 "t = torch.zeros(4).to(torch.float64)",
                 "t = torch.zeros(4).split(2)[1]",
                 "t = torch.nn.functional.pad(torch.zeros(2), (1, 1))"):
        with pytest.raises(device.DeviceError, match="_strict_probe.py:1"):
            as_toolkit_code(f"{line}\ndist.all_reduce(t)")
    as_toolkit_code("t = torch.zeros(2).to(device.rank_device())\ndist.all_reduce(t)")  # moved: fine
    # copying host data into a device tensor (loading weights) is a hand-off, not a host tensor
    as_toolkit_code("t = device.zeros(2, dtype=torch.float32)\nt.copy_(torch.ones(2))\ndist.all_reduce(t)")

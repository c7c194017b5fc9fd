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

from tests.helpers.device import as_toolkit_code
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


def test_collectives_refuse_what_nccl_refuses_non_contiguous_tensors(strict_group):
    """NCCL's contiguity rule (``device.NCCL_RAW_ARGUMENTS``), which gloo forgives by copying: the
    error names the collective, the argument and its strides, and the code that asked; what NCCL
    copies through a flat buffer (all_gather's output list) or takes as channels-last passes."""
    rows = "pos = torch.arange(8, device=device.rank_device()).expand(2, 8)\n"  # stride (0, 1)
    with pytest.raises(device.DeviceError, match=r"all_gather of a non-contiguous tensor \(tensor: shape \(2, 4\), "
                                                 r"stride \(0, 1\)\), called from toolkit/_strict_probe.py:2"):
        as_toolkit_code(rows + "dist.all_gather([torch.empty_like(pos[:, :4])], pos[:, :4])")
    for call in ("dist.all_reduce(whole.t())", "dist.broadcast(whole[:, 1], 0)",
                 "dist.all_to_all([whole.t()], [whole.clone()])",
                 "dist.all_gather_into_tensor(whole.clone(), whole.t())",
                 "dist.reduce_scatter_tensor(whole.t(), whole.clone())"):
        with pytest.raises(device.DeviceError, match="non-contiguous"):
            as_toolkit_code("whole = device.zeros(3, 3, dtype=torch.float32)\n" + call)
    scope = as_toolkit_code(
        rows + "out = device.zeros(8, 2, dtype=torch.int64).t()\n"  # a non-contiguous output: copied into
        "dist.all_gather([out], pos.contiguous())\n"
        "image = device.zeros(1, 3, 2, 2, dtype=torch.float32).to(memory_format=torch.channels_last)\n"
        "dist.all_reduce(image)\n")
    assert scope["out"].tolist() == scope["pos"].tolist()


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


# --- strict mode and compiled code --------------------------------------------------------------------

def test_compiled_flex_attention_runs_under_strict_mode(strict_group, capsys, monkeypatch):
    """dynamo traces an active torch-function mode into what it compiles: strict mode used to make
    ``torch.compile(flex_attention)`` fail (InternalTorchDynamoError: too many values to unpack),
    and graph-break every other compiled function on ``sys._getframe``. Compiled flex (forward: the
    CPU has no flex backward) with a document block mask equals sdpa with the boolean mask; a second
    shape compiles a second kernel, past dynamo's default recompile limit (set to 1 here), and says so."""
    from torch._dynamo.utils import counters

    from toolkit.adapters.attention import TokenLayout, compiled_flex
    torch._dynamo.reset()  # no kernel left from an earlier test of this process
    flex = compiled_flex()
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    breaks, kernels = sum(counters["graph_break"].values()), flex.kernels()
    for s in (128, 192):
        g = torch.Generator().manual_seed(s)
        q, k, v = (torch.randn(2, 4, s, 16, generator=g) for _ in range(3))
        docs = torch.tensor([[0] * (s // 3) + [1] * (s - s // 3), [0] * s])
        layout = TokenLayout.of(torch.zeros(2, s, dtype=torch.long), document_ids=docs)
        with torch.no_grad():
            got = flex(q, k, v, block_mask=layout.block_mask(None), scale=0.25, enable_gqa=True)
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=layout.allowed(None), scale=0.25)
        torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    assert flex.kernels() == kernels + 2
    assert f"compiled flex_attention: kernel {kernels + 2} (of at most 64)" in capsys.readouterr().out
    assert sum(counters["graph_break"].values()) == breaks


@pytest.mark.slow
def test_a_real_rank_runs_strict(tmp_path, data_cache):
    """Every rank the suite starts runs in strict mode (tests/conftest.py -> toolkit.train.worker):
    a tensor toolkit code leaves on the host (here a fault after step 1, an all-reduce of
    ``torch.zeros(1)``, on both ranks so that without strict mode the job simply goes on) fails
    the job, as NCCL would on a GPU."""
    from tests.helpers.runs import train
    fault = "host_collective:step=1:rank=0;host_collective:step=1:rank=1"
    proc = train(tmp_path / "run", data_cache, env={"TOOLKIT_FAULT": fault}, check=False)
    assert proc.returncode != 0, "the job finished: its ranks did not run in strict device mode"
    assert "DeviceError: torch.distributed.all_reduce of a host tensor made at" in proc.stdout + proc.stderr
    assert "faults.py" in proc.stdout + proc.stderr

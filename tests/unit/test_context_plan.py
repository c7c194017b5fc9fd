"""megatron.cp in the plan (toolkit/plan/checks.py) and the estimate: the sizes checked before launch,
each refusal naming the valid choices; the layout record and description; per-rank activation
memory falling as 1 / cp. No process group."""
from __future__ import annotations

import pytest

from toolkit.config import ConfigError, load_config
from toolkit.estimate.memory import memory
from toolkit.estimate.steptime import Cluster, step_time
from toolkit.families.tiny import tiny_config
from toolkit.layout import kv_copies, valid_cp
from toolkit.plan import build_plan

LLAMA = tiny_config("llama")  # 4 heads, 2 KV heads


def plan(world: int, *overrides: str, hf_config=LLAMA):
    cfg = load_config(None, ["backend=megatron", "data.seq_len=64", *overrides])
    return build_plan(cfg, [world], hf_config=hf_config)


def test_world_is_dp_tp_pp_cp_and_the_layout_records_cp():
    lay = plan(8, "megatron.cp=2", "megatron.tp=2").layout(8)
    assert (lay.dp, lay.tp, lay.pp, lay.cp) == (2, 2, 1, 2)
    assert lay.record()["cp"] == 2 and "cp=2" in lay.describe()
    one = plan(2).layout(2)  # a cp = 1 record is what it was before cp existed: old checkpoints resume "as saved"
    assert "cp" not in one.record() and "cp" not in one.describe()


@pytest.mark.parametrize("overrides,world,message", [
    (["megatron.cp=2"], 3, r"world size 3 is not divisible by megatron.tp=1 x megatron.pp=1 x megatron.cp=2; "
                           r"choose tp x pp x cp in \[1, 3\] or nproc a multiple of 2"),
    (["megatron.cp=4", "megatron.tp=2"], 8, r"num_attention_heads=4 / megatron.tp=2 = 2 heads per TP rank do not "
                                            r"divide over megatron.cp=4 .*; choose cp in \[1, 2\]"),
    (["megatron.cp=2", "data.seq_len=30"], 2, r"data.seq_len=30 is not divisible by 2 x megatron.cp=2 = 4: .*choose "
                                              r"seq_len a multiple of 4, or cp in \[1\]"),
    (["megatron.cp=2", "megatron.tp=2", "megatron.sequence_parallel=true", "data.seq_len=36"], 4,
     r"data.seq_len=36 is not divisible by 2 x megatron.cp=2 x megatron.tp=2 \(sequence parallelism\) = 8"),
    (["megatron.cp=2", "megatron.attention=local"], 2, r"megatron.cp=2 needs the toolkit's core attention .*"
                                                       r"set megatron.attention=auto"),
])
def test_sizes_are_refused_naming_the_valid_choices(overrides, world, message):
    with pytest.raises(ConfigError, match=message):
        plan(world, *overrides)


def test_cp_must_be_positive():
    with pytest.raises(Exception, match=r"megatron.cp=0 must be >= 1"):
        load_config(None, ["backend=megatron", "megatron.cp=0"])


def test_valid_choices_and_kv_copies():
    assert valid_cp(heads=4, tp=1, seq_len=64) == [1, 2, 4]
    assert valid_cp(heads=12, tp=2, seq_len=24) == [1, 2, 3, 6]
    assert valid_cp(heads=12, tp=2, seq_len=24, sequence_parallel=True) == [1, 2, 3, 6]
    assert valid_cp(heads=12, tp=2, seq_len=20, sequence_parallel=True) == [1]
    # KV heads per TP rank -> copies each needs so that they divide over cp
    assert [kv_copies(kv, 4) for kv in (1, 2, 4, 8, 6)] == [4, 2, 1, 1, 2]


def test_activation_memory_per_rank_falls_as_one_over_cp():
    """Same global batch and world (4 ranks): cp trades DP replicas for shares of each row."""
    acts = {}
    for cp in (1, 2, 4):
        p = plan(4, f"megatron.cp={cp}", "data.seq_len=4096")
        m = memory(p.config, p.model, p.layout(4))
        acts[cp] = m.activations
        assert m.logits_loss == pytest.approx(memory(*_at(p, 1)).logits_loss / cp)
    assert acts[2] == pytest.approx(acts[1] / 2)
    # cp = 4 > 2 KV heads: each is repeated twice inside attention (more than a quarter, by the KV part)
    assert acts[1] / 4 < acts[4] < acts[1] / 4 * 1.1


def _at(p, cp):
    cfg = p.config.model_copy(update={"megatron": p.config.megatron.model_copy(update={"cp": cp})})
    return cfg, p.model, build_plan(cfg, [4], hf_config=LLAMA).layout(4)


def test_step_time_counts_the_all_to_alls():
    p = plan(4, "megatron.cp=2")
    groups = {c.group: c for c in step_time(p.config, p.model, p.layout(4), Cluster()).collectives}
    assert groups["cp"].kind == "all-to-all" and groups["cp"].ranks == 2
    assert groups["dp"].ranks == 4  # gradients reduced over dp x cp
    assert "cp" not in {c.group for c in step_time(*_at(p, 1), Cluster()).collectives}


class _CPGroup:
    """What megatron-core's slicer asks of a context-parallel group: its size and this rank's place."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_chunk_index_is_megatrons_layout_and_its_inverse(cp, monkeypatch):
    """The ranks' tokens in rank order, as megatron-core's own slicer (``get_batch_on_this_cp_rank``, here
    given each rank's place) cuts a sequence of positions: ``chunk_index`` names that order of the 2 x cp
    chunks, and ``natural=True`` gives the positions back in token order."""
    import torch
    import torch.distributed as dist
    from megatron.core.utils import get_batch_on_this_cp_rank

    from toolkit.adapters.megatron.context import _reorder, chunk_index, chunk_order
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # megatron reads the group only in a job
    positions = torch.arange(2 * cp * 3)
    held = torch.cat([get_batch_on_this_cp_rank({"x": positions[None]}, _CPGroup(cp, r))["x"][0] for r in range(cp)])
    assert torch.equal(held, positions.reshape(2 * cp, 3)[chunk_index(cp, "cpu")].flatten()), held
    assert chunk_index(cp, "cpu").tolist() == chunk_order(cp)
    assert torch.equal(_reorder(held, cp, natural=True), positions)
    assert torch.equal(_reorder(positions, cp, natural=False), held)

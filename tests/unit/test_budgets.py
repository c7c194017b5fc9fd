"""Per-rank phase budgets and the process-group timeout (``toolkit/watch/budgets.py``): a rank's save
and load budgets count the bytes that rank moves, not the whole model's (a 70B hung save is caught in
minutes, not hours), and every process group's timeout exceeds every budget, so that a rank waiting
in a collective for a healthy peer's long write is never killed before the watchdog judges it."""
from __future__ import annotations

import pytest

from toolkit.config import RestartConfig, load_config
from toolkit.plan import build_plan
from toolkit.watch.budgets import RankShare, collective_timeout_s, phase_budgets, rank_share

B70 = 70_000_000_000


def test_a_ranks_save_counts_its_slice_of_the_weights_and_its_nodes_part_of_the_optimizer():
    restart = RestartConfig()  # 300 s + bytes at 100 MB/s
    whole = phase_budgets(restart, B70, B70)
    assert whole["save"] == 300 + B70 * 16 / 1e8  # 11,500 s: over 3 hours to catch a hung save
    # megatron tp8 x pp4 x dp16 on 64 nodes of 8: the weights in 32 slices, the optimizer in 512 shards
    mine = phase_budgets(restart, B70, B70, RankShare(mp=32, optimizer_shards=512, local=8))
    assert mine["save"] == pytest.approx(300 + (B70 * 4 / 32 + B70 * 12 * 8 / 512) / 1e8)  # 519 s
    assert mine["load"] == pytest.approx(300 + (B70 * 4 / 32 + B70 * 4 / 32 + B70 * 12 * 8 / 512) / 1e8)
    # rank 0 converts and exports alone, and its peers wait for it: whole-model, as before
    assert mine["export"] == whole["export"] and mine["reshard"] == whole["reshard"]
    assert mine["step"] == whole["step"] == 300
    # ZeRO-0 keeps the optimizer whole (rank 0 writes it); one node's persister copies all its ranks'
    assert phase_budgets(restart, B70, B70, RankShare(optimizer_shards=1))["save"] == whole["save"]
    assert phase_budgets(restart, B70, B70, RankShare(optimizer_shards=8, local=8))["save"] == whole["save"]
    # an explicit budget is the budget
    assert phase_budgets(RestartConfig(save_timeout_s=9), B70, B70, RankShare(mp=32))["save"] == 9


def test_the_process_group_timeout_exceeds_every_ranks_budget():
    restart = RestartConfig()
    whole = phase_budgets(restart, B70, B70)
    timeout = collective_timeout_s(whole)
    for share in (RankShare(), RankShare(mp=32, optimizer_shards=512, local=8), RankShare(optimizer_shards=2)):
        assert max(phase_budgets(restart, B70, B70, share).values()) < timeout
    assert timeout == max(whole.values()) + whole["step"]


@pytest.mark.parametrize("overrides,world,local,expected", [
    (["zero.stage=2"], 2, 2, RankShare(mp=1, optimizer_shards=2, local=2)),
    (["zero.stage=0"], 2, 1, RankShare(mp=1, optimizer_shards=1, local=1)),
    (["backend=megatron", "megatron.tp=2"], 4, 2, RankShare(mp=2, optimizer_shards=4, local=2)),
])
def test_the_share_is_read_from_the_layout(overrides, world, local, expected):
    plan = build_plan(load_config(overrides=overrides), [world])
    assert rank_share(plan, world, local) == expected

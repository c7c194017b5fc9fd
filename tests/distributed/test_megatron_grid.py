"""``adapters/megatron/grid.py``, the one reader of megatron's parallel state: each rank's place
against the rank arithmetic of megatron's default order (tp fastest, then dp, then pp) for every
2-rank layout, and a clear error where groups left by an earlier engine disagree with the layout.

Bugs these catch: a rank read from the wrong group (tp for dp), the stage ends of a pipeline
swapped, the expert replicas' rank taken from the dense group under ep, and sizes read from the
layout silently disagreeing with the groups megatron holds, and megatron's groups keeping their own
30-minute timeout instead of the job's (longer than a lone 70B save: a waiting rank killed first)."""
from __future__ import annotations

import pytest

from tests.helpers.ranks import run_ranks
from toolkit.layout import Layout

LAYOUTS = {"tp2": dict(tp=2, dp=1), "pp2": dict(pp=2, dp=1), "dp2": dict(dp=2), "dp2_ep2": dict(dp=2, ep=2)}


def _places(rank, world, sizes):
    import torch
    from megatron.core import parallel_state as ps

    from toolkit.adapters.megatron import grid
    lay = Layout(backend="megatron", world=world, **sizes)
    try:
        place = grid.initialize(lay, timeout_s=150)  # the job's process-group timeout, in whole minutes
        return {"place": place, "ends": grid.stage_ends(None), "ep_rank": grid.ep_rank(),
                "tp_group": grid.tp_group().size(), "dp_group": grid.dp_group().size(),
                "timeout_s": grid.dp_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds()}
    finally:
        ps.destroy_model_parallel()


@pytest.mark.parametrize("name", LAYOUTS)
def test_each_rank_finds_its_place(tmp_path, name):
    sizes = LAYOUTS[name]
    tp, pp, dp, ep = (sizes.get(k, 1) for k in ("tp", "pp", "dp", "ep"))
    for rank, got in enumerate(run_ranks(_places, 2, tmp_path, sizes)):
        place = got["place"]
        assert (place.tp_rank, place.dp_rank, place.pp_rank) == (rank % tp, rank // tp % dp, rank // (tp * dp))
        # with ep the ranks of a DP group hold different experts: each is its experts' only replica
        assert place.expert_dp_rank == (0 if ep > 1 else place.dp_rank)
        assert got["ep_rank"] == (rank % ep if ep > 1 else 0)
        assert got["ends"] == (place.pp_rank == 0, place.pp_rank == pp - 1)
        assert (got["tp_group"], got["dp_group"]) == (tp, dp)
        assert got["timeout_s"] == 180  # not megatron's default 30 minutes: watch/budgets.py sets it


def _mismatch(rank, world):
    from megatron.core import parallel_state as ps

    from toolkit.adapters.megatron import grid
    ps.initialize_model_parallel(tensor_model_parallel_size=2)  # an earlier engine's groups, not destroyed
    try:
        grid.initialize(Layout(backend="megatron", world=world, dp=2))
    except RuntimeError as e:
        return str(e)
    finally:
        ps.destroy_model_parallel()
    return None


def test_groups_left_at_another_layout_are_refused(tmp_path):
    for message in run_ranks(_mismatch, 2, tmp_path):
        assert message is not None and "'tp': 2" in message and "'tp': 1" in message
        assert "destroy_model_parallel()" in message


def _closed(rank, world):
    import gc
    import os
    import weakref

    import torch.distributed as dist

    from tests.helpers.ranks import megatron_engine
    from toolkit.config import validate
    from toolkit.families.tiny import tiny_model

    def held():  # process groups torch knows, and this process's threads (gloo's are C++ threads)
        return len(dist.distributed_c10d._world.pg_map), len(os.listdir("/proc/self/task"))
    before = held()
    engine = megatron_engine(validate({"backend": "megatron", "megatron": {"tp": 2},
                                       "train": {"global_batch_size": 2, "micro_batch_size": 1}}), tiny_model("llama"))
    built = held()
    alive = [weakref.ref(engine), weakref.ref(engine.model[0])]  # the engine, and its DDP module (the weights)
    engine.close()
    engine.close()  # idempotent
    del engine
    gc.collect()
    return {"before": before, "built": built, "closed": held(), "freed": [ref() is None for ref in alive]}


def test_close_frees_the_engine_and_its_process_groups(tmp_path):
    """``MegatronEngine.close`` (the trainer's last call, and the suite's ``release_megatron``): the
    process groups megatron made are destroyed with their threads, and nothing keeps the engine alive
    (DDP's gradient hooks and the config's callbacks did: 17 groups, 51 threads per engine)."""
    for got in run_ranks(_closed, 2, tmp_path):
        print(f"\ngroups and threads: before {got['before']}, built {got['built']}, closed {got['closed']}")
        assert got["built"][0] > got["before"][0] and got["closed"][0] == got["before"][0]
        assert got["closed"][1] < got["built"][1]
        assert got["freed"] == [True, True]

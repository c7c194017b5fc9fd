"""This rank's place in megatron's process grid: the one module that talks to megatron-core's global
parallel state (``megatron.core.parallel_state``; ``tests/test_architecture.py`` keeps it so).

Sizes are the run's ``Layout`` (tp, pp, vpp, ep, dp): the engine and the model config carry them.
What only the running process knows is read here: its ranks (``Place``, read once when the groups
are made) and its process groups (objects megatron holds; asked for where a collective needs one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.plan.layout import Layout


@dataclass(frozen=True)
class Place:
    """This rank's coordinates in the grid (fixed once megatron's groups exist)."""
    tp_rank: int
    pp_rank: int
    dp_rank: int
    expert_dp_rank: int
    """Rank among the replicas of this rank's experts (its DP rank without expert parallelism)."""


def initialize(lay: Layout, timeout_s: float = 1800) -> Place:
    """megatron's process groups for ``lay`` (kept if this process made them already) and this
    rank's place in them; ``timeout_s``: their collectives' timeout, the job's process-group timeout
    (``launch.budgets.plan_collective_timeout_s``; megatron's own default is 30 minutes)."""
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                                     virtual_pipeline_model_parallel_size=lay.vpp,
                                     expert_model_parallel_size=lay.ep,
                                     distributed_timeout_minutes=math.ceil(timeout_s / 60))
    _check_sizes(lay)
    expert_dp = ps.get_expert_data_parallel_rank() if lay.ep > 1 else ps.get_data_parallel_rank()
    return Place(tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                 dp_rank=ps.get_data_parallel_rank(), expert_dp_rank=expert_dp)


def _check_sizes(lay: Layout) -> None:
    """The groups megatron holds are the layout's: sizes are read from the layout everywhere else, so
    groups left by an earlier engine at another layout in this process would split the work wrongly."""
    from megatron.core import parallel_state as ps
    held = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size()}
    wanted = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep}
    if held != wanted:
        raise RuntimeError(f"megatron's process groups in this process are {held}, the run's layout is {wanted}: "
                           "an earlier engine left them; call megatron.core.parallel_state.destroy_model_parallel() "
                           "before building an engine at another layout")


def stage_ends(vp_stage: int | None) -> tuple[bool, bool]:
    """(pre_process, post_process) of the model chunk of virtual stage ``vp_stage`` on this rank:
    whether it holds the embedding (the first stage) and the output layer (the last)."""
    from megatron.core import parallel_state as ps
    return (ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
            ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage))


def tp_rank() -> int:
    """This rank's tensor-parallel rank, for code megatron calls without the engine (routers, hooks)."""
    from megatron.core import parallel_state as ps
    return ps.get_tensor_model_parallel_rank()


def ep_rank() -> int:
    """This rank's expert-parallel rank (0 without expert parallelism)."""
    from megatron.core import parallel_state as ps
    return ps.get_expert_model_parallel_rank()


def tp_group(expert: bool = False):
    """The tensor-parallel process group (of the routed experts' weights when ``expert``)."""
    from megatron.core import parallel_state as ps
    return ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()


def dp_group():
    """The data-parallel process group of this rank's (dense) replicas."""
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group()

"""This rank's place in megatron's process grid: the one module that talks to megatron-core's global
parallel state (``megatron.core.parallel_state``; ``tests/test_architecture.py`` keeps it so).

Sizes are the run's ``Layout`` (tp, pp, vpp, ep, cp, dp): the engine and the model config carry them.
What only the running process knows is read here: its ranks (``Place``, read once when the groups
are made) and its process groups (objects megatron holds; asked for where a collective needs one).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from toolkit.layout import Layout


@dataclass(frozen=True)
class Place:
    """This rank's coordinates in the grid (fixed once megatron's groups exist)."""
    tp_rank: int
    pp_rank: int
    dp_rank: int
    expert_dp_rank: int
    """Rank among the replicas of this rank's experts (its DP rank without expert parallelism)."""
    cp_rank: int = 0
    """Rank in the context-parallel group (which chunks of every sequence this rank holds)."""


def initialize(lay: Layout, timeout_s: float = 1800) -> Place:
    """megatron's process groups for ``lay`` (kept if this process made them already) and this
    rank's place in them; ``timeout_s``: their collectives' timeout, the job's process-group timeout
    (``watch.budgets.plan_collective_timeout_s``; megatron's own default is 30 minutes)."""
    from megatron.core import parallel_state as ps
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=lay.tp, pipeline_model_parallel_size=lay.pp,
                                     virtual_pipeline_model_parallel_size=lay.vpp,
                                     expert_model_parallel_size=lay.ep, context_parallel_size=lay.cp,
                                     distributed_timeout_minutes=math.ceil(timeout_s / 60))
    _check_sizes(lay)
    # the replicas of dense weights span dp x cp (CP ranks hold the same weights); megatron's expert
    # data-parallel group spans them too
    expert_dp = ps.get_expert_data_parallel_rank() if lay.ep > 1 else ps.get_data_parallel_rank(with_context_parallel=True)
    return Place(tp_rank=ps.get_tensor_model_parallel_rank(), pp_rank=ps.get_pipeline_model_parallel_rank(),
                 dp_rank=ps.get_data_parallel_rank(), expert_dp_rank=expert_dp,
                 cp_rank=ps.get_context_parallel_rank())


def _check_sizes(lay: Layout) -> None:
    """The groups megatron holds are the layout's: sizes are read from the layout everywhere else, so
    groups left by an earlier engine at another layout in this process would split the work wrongly."""
    from megatron.core import parallel_state as ps
    held = {"tp": ps.get_tensor_model_parallel_world_size(), "pp": ps.get_pipeline_model_parallel_world_size(),
            "dp": ps.get_data_parallel_world_size(), "ep": ps.get_expert_model_parallel_world_size(),
            "cp": ps.get_context_parallel_world_size()}
    wanted = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "cp": lay.cp}
    if held != wanted:
        raise RuntimeError(f"megatron's process groups in this process are {held}, the run's layout is {wanted}: "
                           "an earlier engine left them; call megatron.core.parallel_state.destroy_model_parallel() "
                           "before building an engine at another layout")


def destroy() -> None:
    """Destroy the process groups megatron-core's global state holds, and forget them: its own
    ``destroy_model_parallel`` forgets them without destroying them (each gloo group keeps 3 threads)
    and leaves some set (the intra-DP ones). Not collective: every rank destroys its own handles."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    groups = {id(g): g for g in _process_groups(vars(ps).values())}
    ps.destroy_model_parallel()
    for name, value in vars(ps).items():
        if _process_groups([value]):
            setattr(ps, name, None)
    for group in groups.values():
        if group is not dist.group.WORLD and group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)


def _process_groups(values) -> list:
    import torch.distributed as dist
    found = []
    for v in values:
        if isinstance(v, dist.ProcessGroup):
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found += _process_groups(v)
        elif isinstance(v, dict):
            found += _process_groups(v.values())
    return found


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


def cp_rank() -> int:
    """This rank's context-parallel rank (0 without context parallelism)."""
    from megatron.core import parallel_state as ps
    return ps.get_context_parallel_rank()


def sequence_group(sequence_parallel: bool):
    """The ranks that each hold a share of a micro-batch's tokens (the TP group under sequence
    parallelism, the CP group under context parallelism, megatron's TP x CP group with both), or
    None where every rank holds them all."""
    from megatron.core import parallel_state as ps
    cp = ps.get_context_parallel_world_size() > 1
    if sequence_parallel and cp:
        return ps.get_tensor_and_context_parallel_group()
    if sequence_parallel:
        return ps.get_tensor_model_parallel_group()
    return ps.get_context_parallel_group() if cp else None


def tp_group(expert: bool = False):
    """The tensor-parallel process group (of the routed experts' weights when ``expert``)."""
    from megatron.core import parallel_state as ps
    return ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()


def dp_group():
    """The data-parallel process group of this rank's (dense) replicas."""
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group()


def cp_group():
    """The context-parallel process group: the ranks that split each sequence."""
    from megatron.core import parallel_state as ps
    return ps.get_context_parallel_group()


def dp_cp_group():
    """The data-parallel group with the context-parallel ranks: every rank holding this rank's
    (dense) weights, over which megatron's DDP sums gradients and its distributed optimizer shards."""
    from megatron.core import parallel_state as ps
    return ps.get_data_parallel_group(with_context_parallel=True)

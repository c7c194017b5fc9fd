"""The rank harness: ``run_ranks`` runs a function in gloo ranks forked from this test process's
forkserver and returns what each rank returned; ``megatron_engine`` builds the engine a rank drives."""
from __future__ import annotations

import gc
import os
import sys
import warnings

import torch
import torch.multiprocessing as mp

from tests.helpers.runs import start_forkserver
from toolkit import device
from toolkit.parallel import free_port


def _rank_main(rank, world, port, fn, out_dir, args):
    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if device.strict_requested():  # as toolkit.train.worker does: the suite runs every rank in strict mode
        device.enable_strict()
    try:
        result = fn(rank, world, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()
    # The result is on disk and the group is down: skip interpreter teardown. A library's
    # background std::thread still joinable at exit aborts the process ("terminate called without
    # an active exception", seen once in CI after a DeepSpeed load had finished), which would fail
    # a test whose ranks all completed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world: int, tmp_path, *args, timeout: float = 300) -> list:
    """Run ``fn(rank, world, *args)`` in ``world`` gloo ranks; their return values, in rank order."""
    start_forkserver()
    ctx = mp.start_processes(_rank_main, args=(world, free_port(), fn, str(tmp_path), args), nprocs=world,
                             join=False, start_method="forkserver")
    import time
    deadline = time.monotonic() + timeout
    while not ctx.join(timeout=max(1.0, deadline - time.monotonic())):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"ranks did not finish in {timeout}s")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def megatron_engine(cfg, model, hf_state=None):
    """A ``MegatronEngine`` for this job's world size from an HF ``model`` (its config, and its weights
    unless ``hf_state`` is given), as tests that drive the engine directly build it."""
    import torch.distributed as dist

    from toolkit.adapters.megatron import MegatronEngine
    from toolkit.plan import build_plan
    plan = build_plan(cfg, [dist.get_world_size()], hf_config=model.config)
    return MegatronEngine(plan, model.state_dict() if hf_state is None else hf_state)


def release_megatron() -> None:
    """Between the engines of one rank job: megatron-core's ``destroy_model_parallel`` forgets its process
    groups without destroying them, so a job building engine after engine kept every group and gloo's
    threads with it (a parity job of ~80 layouts reached ~400 gloo threads per rank, a load average over
    1,000 on 2 cores and 6x the run time). Destroys the groups megatron's globals hold, then forgets them."""
    import torch.distributed as dist
    from megatron.core import parallel_state
    groups = {id(g): g for g in _process_groups(vars(parallel_state).values())}
    parallel_state.destroy_model_parallel()
    for name, value in vars(parallel_state).items():  # destroy_model_parallel leaves some (the intra-DP ones)
        if _process_groups([value]):
            setattr(parallel_state, name, None)
    for group in groups.values():
        if group is not dist.group.WORLD and group in dist.distributed_c10d._world.pg_map:
            dist.destroy_process_group(group)
    groups.clear()
    _drop_gradient_hooks()
    gc.collect()  # the engine's reference cycles hold the groups too: their threads end when they are freed


def _drop_gradient_hooks() -> None:
    """megatron's DistributedDataParallel hooks each parameter's gradient accumulator with a closure over
    itself: a cycle through autograd's C++ nodes that Python's collector cannot see, so an engine that
    went out of scope lived on with its process groups (17 gloo groups, 51 threads per engine). Dropping
    the accumulators breaks it."""
    from megatron.core.distributed import DistributedDataParallel
    from megatron.core.transformer import TransformerConfig
    for obj in gc.get_objects():
        if isinstance(obj, DistributedDataParallel):
            obj.grad_accs.clear()
        elif isinstance(obj, TransformerConfig):  # the engine's callbacks: closures over the engine
            obj.finalize_model_grads_func = obj.no_sync_func = obj.grad_scale_func = obj.param_sync_func = None


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

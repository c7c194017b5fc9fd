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
    gc.freeze()  # what the forkserver imported lives as long as the rank: no collection walks it (release_megatron)
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
    """Between the engines of one rank job: every ``MegatronEngine`` still alive closed
    (``MegatronEngine.close``: its process groups destroyed, the DDP hooks and config callbacks that
    kept it alive dropped), megatron's groups destroyed where no engine made them, and collected.
    Before this, a parity job of ~80 layouts reached ~400 gloo threads per rank, a load average over
    1,000 on 2 cores and 6x the run time."""
    from megatron.core import parallel_state

    from toolkit.adapters.megatron import MegatronEngine, grid
    groups = grid._process_groups(vars(parallel_state).values())  # held past the engines: freed below
    for obj in gc.get_objects():
        if isinstance(obj, MegatronEngine):
            obj.close()
    grid.destroy()
    gc.collect()  # the engines' reference cycles, broken by close(), hold their memory until collected
    _free_in_parallel(groups)
    # What survives lives on (modules megatron and HF imported, their caches): frozen, so that the next
    # release's scan and collection walk only what the next engine made. Walking everything took
    # 0.9 s per release, 60% of the parity job's time (cProfile of _rank_parity).
    gc.freeze()


def _free_in_parallel(groups: list) -> None:
    """Drop the last references to destroyed process groups, one thread each: a gloo group's
    destructor waits ~10 ms for its loop thread (17 groups: 0.17 s per engine, one after the
    other), with the GIL released."""
    import threading
    threads = [threading.Thread(target=list.clear, args=([g],)) for g in set(groups)]
    groups.clear()
    for t in threads:
        t.start()
    for t in threads:
        t.join()

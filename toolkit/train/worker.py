"""One rank of a training job: ``python -m toolkit.train.worker RUN_DIR/plan.json``.

Started by the toolkit's launcher (which wrote the plan), or, through ``toolkit train`` itself, by
torchrun, srun or the deepspeed launcher; reads its rank from the environment they set.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from toolkit import device, heap
from toolkit.config import ConfigError, RunConfig
from toolkit.data import load_tokenizer, prepare_data
from toolkit.engine import Engine
from toolkit.parallel import adopt_slurm_env, init_process_group, local_world_size, seed_everything
from toolkit.plan import Plan, read_plan, write_plan
from toolkit.watch.budgets import phase_budgets, plan_collective_timeout_s, rank_share
from toolkit.watch.heartbeat import Heartbeat
from toolkit.watch.monitor import register_stack_dump


def run_worker(plan: Plan, record_plan: bool = False) -> None:
    """``record_plan``: this job's ranks made the plan themselves (torchrun, srun, the deepspeed
    launcher): rank 0 writes it to RUN_DIR/plan.json, replacing a previous job's."""
    heap.return_large_frees()  # first: freed activations go back to the OS, not into glibc's heap (heap.py)
    run_dir = Path(plan.config.run_dir)
    adopt_slurm_env()  # RANK before the process group: the heartbeat and stack files are per rank
    budgets = phase_budgets(plan.config.restart, *plan.trainable_parameters(), share=_rank_share(plan))
    heartbeat = _loading_heartbeat(run_dir, budgets)
    init_process_group(timeout_s=plan_collective_timeout_s(plan))
    rank = dist.get_rank()
    heartbeat.mark("process_group")
    if device.strict_requested():
        device.enable_strict()
    device.use_tf32(plan.config.model.tf32)
    lock = _own_run_dir(plan, rank) if record_plan else None  # held while this process lives
    tokenizer, data = _prepare_data_rank0_first(plan.config, rank)
    heartbeat.mark("data")
    seed_everything(plan.config.train.seed)
    engine = build_engine(plan, run_dir, rank)
    heartbeat.mark("engine_built")
    from toolkit.train.trainer import Trainer
    Trainer(plan, engine, data, tokenizer, run_dir, heartbeat).fit()
    engine.close()  # megatron: its process groups and the hooks that keep it alive
    dist.barrier()
    dist.destroy_process_group()
    if lock is not None:
        lock.release()


def _own_run_dir(plan: Plan, rank: int):
    """A job that torchrun, srun or the deepspeed launcher started: rank 0 does what ``toolkit train``
    does before launch (``run.py``): holds the run directory's lock (until it exits), checks
    and prepares the run directory (on a restart, ``TORCHELASTIC_RESTART_COUNT`` > 0, it continues its
    own run, --resume never included) and writes plan.json. Its refusal is every rank's (collective).
    Returns rank 0's lock."""
    refusal, lock = [None], None
    if rank == 0:
        from toolkit.checkpoint.lineage import plan_run_dir, prepare_run_dir
        from toolkit.storage.rundir import RunDirLock
        try:
            lock = RunDirLock(Path(plan.config.run_dir))
            note = lock.acquire()
            restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
            state = plan_run_dir(plan, "auto" if restarted else None)
            for line in [note, *prepare_run_dir(state), *state.lines()]:
                if line:
                    print(f"toolkit: {line}", flush=True)
            write_plan(plan, Path(plan.config.run_dir))
        except ConfigError as exc:
            refusal = [str(exc)]
            if lock is not None:
                lock.release(undo=True)
    dist.broadcast_object_list(refusal, src=0)
    if refusal[0]:
        raise ConfigError(refusal[0])
    return lock


def _rank_share(plan: Plan):
    """This rank's share of the model's bytes, from the job's size in the environment."""
    return rank_share(plan, int(os.environ.get("WORLD_SIZE", "1")), local_world_size())


def _loading_heartbeat(run_dir: Path, budgets: dict[str, float]) -> Heartbeat:
    """The rank's heartbeat, in phase ``load`` from its first moment (the agent watches a rank from
    its start), and its stacks dumpable on the watchdog's request before the process group exists."""
    rank = int(os.environ.get("RANK", "0"))
    register_stack_dump(run_dir, rank)
    heartbeat = Heartbeat(run_dir, rank, budgets)
    heartbeat.beat(None, "load")
    return heartbeat


def _prepare_data_rank0_first(cfg: RunConfig, rank: int):
    """Rank 0 tokenizes and fills the cache; the others then read it (no concurrent cache writes)."""
    if rank == 0:
        tokenizer = load_tokenizer(cfg)
        data = prepare_data(cfg, tokenizer)
    dist.barrier()
    if rank != 0:
        tokenizer = load_tokenizer(cfg)
        data = prepare_data(cfg, tokenizer)
    return tokenizer, data


def build_engine(plan: Plan, run_dir: Path, rank: int) -> Engine:
    """This rank's engine for ``plan``: ``plan.config.backend``'s (DeepSpeed ZeRO or megatron-core),
    its model built at the layout of this job's world size with the HF weights of
    ``model.name_or_path`` loaded. Needs the job's process group (``toolkit.parallel.init_process_group``);
    rank 0 writes the backend's resolved settings into ``run_dir``. What ``Trainer`` takes."""
    if plan.config.backend == "megatron":
        from toolkit.adapters.megatron import build_engine
    else:
        from toolkit.adapters.deepspeed import build_engine
    return build_engine(plan, run_dir, rank)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    argv = [a for a in argv if not a.startswith("--local_rank") and not a.startswith("--local-rank")]
    if len(argv) != 1:
        print("usage: python -m toolkit.train.worker RUN_DIR/plan.json (toolkit train writes it)", file=sys.stderr)
        return 2
    plan = read_plan(Path(argv[0]))
    try:
        run_worker(plan)
    except ConfigError as exc:  # a refusal (every checkpoint damaged, another model's): the same on every attempt
        return refuse(Path(plan.config.run_dir), exc)
    return 0


def refuse(run_dir: Path, exc: ConfigError) -> int:
    """Say why this rank refuses the run, in a ``refused`` event (the launcher prints it once, and
    exits 2), and exit ``REFUSED_EXIT``, which the agent never restarts."""
    from toolkit.watch.events import emit
    from toolkit.watch.protocol import REFUSED_EXIT
    emit(run_dir, "refused", rank=int(os.environ.get("RANK", "0")), message=str(exc))
    return REFUSED_EXIT


def preload_modules(backend: str) -> tuple[str, ...]:
    """What a rank of ``backend`` imports before it trains, for the launcher's forkserver to import once.
    Nothing that touches CUDA at import: the launcher forks ranks only on machines without a GPU."""
    common = ("torch", "transformers.modeling_utils", "datasets", "toolkit.data", "toolkit.train.trainer",
              "toolkit.train.worker")
    if backend == "megatron":
        return (*common, "megatron.core.models.gpt", "megatron.core.optimizer", "toolkit.adapters.megatron")
    # JIT ops, lazy imports: once
    return (*common, "deepspeed", "toolkit.adapters.deepspeed", "toolkit.adapters.deepspeed.preload")


if __name__ == "__main__":
    sys.exit(main())

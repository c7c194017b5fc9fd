"""One rank of a training job: ``python -m toolkit.train.worker RUN_DIR/plan.json``.

Started by the toolkit's launcher (which wrote the plan), or, through ``toolkit train`` itself, by
torchrun, srun or the deepspeed launcher; reads its rank from the environment they set.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import torch.distributed as dist

from toolkit import device
from toolkit.config import RunConfig
from toolkit.data import load_tokenizer, prepare_data
from toolkit.engine import Engine
from toolkit.launch.budgets import phase_budgets, plan_collective_timeout_s, rank_share
from toolkit.launch.heartbeat import Heartbeat
from toolkit.launch.monitor import register_stack_dump
from toolkit.parallel import adopt_slurm_env, init_process_group, local_world_size, seed_everything
from toolkit.plan import Plan, read_plan, write_plan


def run_worker(plan: Plan, record_plan: bool = False) -> None:
    """``record_plan``: this job's ranks made the plan themselves (torchrun, srun, the deepspeed
    launcher): rank 0 writes it to RUN_DIR/plan.json, replacing a previous job's."""
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
    if record_plan and rank == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        write_plan(plan, run_dir)
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
    run_worker(read_plan(Path(argv[0])))
    return 0


def forked_main(plan_path: str, launcher_env: dict[str, str]) -> None:
    """A rank forked by the launcher's forkserver (``toolkit.launch.elastic``); ``main`` otherwise."""
    from toolkit.launch.elastic import adopt_launcher_env
    adopt_launcher_env(launcher_env)
    for stream in (sys.stdout, sys.stderr):  # as `python -u` for spawned ranks: lines appear as printed
        stream.reconfigure(line_buffering=True)
    main([plan_path])


def preload_modules(backend: str) -> tuple[str, ...]:
    """What a rank of ``backend`` imports before it trains, for the launcher's forkserver to import once.
    Nothing that touches CUDA at import: the launcher forks ranks only on machines without a GPU."""
    common = ("torch", "transformers.modeling_utils", "datasets", "toolkit.data", "toolkit.train.trainer",
              "toolkit.train.worker")
    if backend == "megatron":
        return (*common, "megatron.core.models.gpt", "megatron.core.optimizer", "toolkit.adapters.megatron")
    return (*common, "deepspeed", "toolkit.adapters.deepspeed", "toolkit.adapters.ds_preload")  # JIT ops, lazy imports: once


if __name__ == "__main__":
    sys.exit(main())

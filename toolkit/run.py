"""What ``toolkit train`` and ``toolkit supervise`` do once their arguments are parsed.

``train``: lock the run directory (one launch writes it at a time: ``storage/rundir.py``), build and
check the plan, tokenize the data once, make every check the ranks would make on the run directory
(the checkpoint they would resume: this run's lineage, model and adapters; room and write access),
then write ``RUN_DIR/plan.json`` and start the local ranks under torch's elastic agent with the
restart policy (``--dry-run``: every check, then print instead). A refusal exits 2 with one message
and leaves the run directory as it was. In a process that torchrun, srun or the deepspeed launcher
started as a rank, train as that rank.
``supervise``: any torchrun-style script under the same agent. The Python API's ``toolkit.train``
is ``train`` here; ``toolkit/cli.py`` only maps flags onto these arguments.
"""
from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from toolkit.config import ConfigError, RunConfig, dump_config
from toolkit.heap import mmap_threshold

if TYPE_CHECKING:
    from toolkit.plan import Plan


@dataclass(frozen=True)
class Nodes:
    """This launcher's place in the job, as torchrun's flags say it: ``nnodes`` nodes at most,
    ``min_nnodes`` at least (an elastic job continues on fewer after a loss; default: ``nnodes``),
    this node's rank and the rendezvous ``HOST:PORT`` (multi-node jobs)."""

    nnodes: int = 1
    min_nnodes: int | None = None
    node_rank: int = 0
    rdzv_endpoint: str | None = None


def train(run: RunConfig | Plan, *, nnodes: int = 1, min_nnodes: int | None = None, node_rank: int = 0,
          rdzv_endpoint: str | None = None, dry_run: bool = False) -> int:
    """Train as ``toolkit train`` does: ``run.nproc`` local ranks (x ``nnodes``) under the elastic
    agent, each running ``toolkit.train.worker``; returns the command's exit code (0 done,
    ``PREEMPTED_EXIT`` saved and stopped on request, 1 failed after the restart budget). ``run``: a
    config (planned here for every node count in ``min_nnodes..nnodes``) or a plan built for those
    world sizes. Raises ``ConfigError`` before anything starts when the run cannot work."""
    from toolkit.parallel import adopt_slurm_env, launched_externally
    from toolkit.plan import Plan, build_plan

    mmap_threshold()  # a bad TOOLKIT_MMAP_THRESHOLD stops here, not in every rank (toolkit/heap.py)
    nodes = Nodes(nnodes, min_nnodes, node_rank, rdzv_endpoint)
    cfg = run.config if isinstance(run, Plan) else run
    if launched_externally(own_rendezvous=rdzv_endpoint is not None):  # torchrun / srun / deepspeed made us a rank
        from toolkit.train.worker import run_worker
        adopt_slurm_env()
        world = int(os.environ.get("WORLD_SIZE", "1"))
        run_worker(run if isinstance(run, Plan) else build_plan(cfg, [world]), record_plan=True)
        return 0
    from toolkit.storage.rundir import claim_run_dir
    with claim_run_dir(Path(cfg.run_dir), nodes.node_rank, dry_run, say=_say) as claim:  # before anything is written
        plan = _checked_plan(run, nodes)
        data = _check_data_before_launch(plan.config)
        state, space = _check_run_dir(plan)
        if dry_run:  # after every check the launch makes: a dry run that passes, launches
            from toolkit.estimate.run import dry_run as print_dry_run
            print(_data_line(plan.config, data))
            print("\n".join(f"# run dir: {line}" for line in [*state.lines(dry_run=True), space]))
            return print_dry_run(plan, nodes.nnodes)
        claim.keep()  # from here on the run directory is this launch's to write
        return _launch(plan, nodes, state)


def _checked_plan(run: RunConfig | Plan, nodes: Nodes) -> Plan:
    """The plan for every node count this launch may run at, with the machine's checks made."""
    from toolkit.plan import Plan, build_plan
    cfg = run.config if isinstance(run, Plan) else run
    worlds = [cfg.nproc * n for n in range(_min_nnodes(nodes), nodes.nnodes + 1)]
    plan = run if isinstance(run, Plan) else build_plan(cfg, worlds)
    for world in worlds:
        plan.layout(world)  # a given plan covers every world size this launch may run at
    if plan.config.metrics.wandb_project:
        from toolkit.observe.metrics import wandb_missing
        if problem := wandb_missing():
            raise ConfigError(problem)
    _check_rank_devices(plan.config)
    if plan.config.backend == "megatron":
        from toolkit.adapters.megatron import check_machine
        check_machine(plan)
    return plan


def _check_run_dir(plan: Plan):
    """Every check the ranks would make on the run directory, made here (``checkpoint/lineage.py``):
    the checkpoint they would resume, write access, room for a checkpoint. Returns the launch's
    decisions (``RunDirPlan``) and a line on the room; raises ``RunDirError``, writing nothing."""
    from toolkit.checkpoint.lineage import plan_run_dir
    from toolkit.storage.rundir import check_writable
    run_dir = Path(plan.config.run_dir)
    check_writable(run_dir)
    state = plan_run_dir(plan)
    return state, _check_room(plan, run_dir, state)


def _check_room(plan: Plan, run_dir: Path, state) -> str:
    """Refuse a run directory without room for one checkpoint (or the export); a line on the room."""
    from toolkit.estimate.goodput import CHECKPOINT_BYTES_PER_PARAM
    from toolkit.storage.rundir import RunDirError, step_dirs
    from toolkit.storage.space import free_bytes, human_bytes
    cfg = plan.config
    trained, _ = plan.trainable_parameters()
    checkpoint = trained * CHECKPOINT_BYTES_PER_PARAM if cfg.checkpoint.every else 0
    need = max(checkpoint, plan.model.total * 4 if cfg.train.export_hf else 0)  # hf_final: fp32 weights
    free = free_bytes(run_dir)
    if free is None:
        return f"free space of {run_dir} unknown"
    if free < need:
        raise RunDirError(f"run dir {run_dir} has {human_bytes(free)} free, and this run writes "
                          f"{human_bytes(need)} at once (a checkpoint: {CHECKPOINT_BYTES_PER_PARAM} bytes per trained parameter; "
                          "hf_final: 4 per parameter): free space there, or choose another --run-dir")
    line = f"{human_bytes(free)} free; a checkpoint takes about {human_bytes(checkpoint)}"
    held = cfg.checkpoint.keep_last + 1  # retention drops the oldest once the newest is committed
    kept = 0 if state.set_aside is not None else len(step_dirs(run_dir))
    if checkpoint and cfg.checkpoint.keep_last > 0 and free < (held - min(kept, held)) * checkpoint:
        line += (f"; keep_last={cfg.checkpoint.keep_last} needs room for {held} at once: a later save will find "
                 "the disk full")
    return line


def supervise(command: list[str], *, nproc: int = 1, run_dir: str | Path = "runs/supervised", nnodes: int = 1,
              min_nnodes: int | None = None, node_rank: int = 0, rdzv_endpoint: str | None = None,
              max_restarts: int = 3, backoff_s: float = 1.0, hang_timeout_s: float = 300.0) -> int:
    """Any torchrun-style script under the same agent, restart policy, hang watchdog and event log.
    ``command``: ``[SCRIPT, ARGS...]`` (a leading ``--`` is dropped); a ``.py`` script runs with this
    Python. Returns the exit code as ``train`` does."""
    from toolkit.launch.elastic import LaunchSpec
    command = command[1:] if command[:1] == ["--"] else command
    if not command:
        raise ConfigError("toolkit supervise needs a command after --, e.g. toolkit supervise --nproc 2 -- train.py")
    script, *script_args = command
    entrypoint, lead = (sys.executable, ["-u", script]) if script.endswith(".py") else (script, [])
    nodes = Nodes(nnodes, min_nnodes, node_rank, rdzv_endpoint)
    spec = LaunchSpec(nproc=nproc, run_dir=Path(run_dir), nnodes=nodes.nnodes, min_nnodes=_min_nnodes(nodes),
                      node_rank=nodes.node_rank,
                      rdzv_endpoint=nodes.rdzv_endpoint, max_restarts=max_restarts,
                      backoff_s=backoff_s, hang_timeout_s=hang_timeout_s)
    from toolkit.storage.rundir import claim_run_dir
    with claim_run_dir(Path(run_dir), nodes.node_rank, say=_say) as claim:  # one supervisor per run directory
        claim.keep()
        return _run_supervised(spec, entrypoint, [*lead, *script_args])


def _check_rank_devices(cfg: RunConfig) -> None:
    """A GPU for each local rank and a safe way of starting them, before anything starts."""
    from toolkit.launch.devices import check_gpu_per_rank, rank_start_method
    check_gpu_per_rank(cfg.nproc)
    rank_start_method()


def _check_data_before_launch(cfg: RunConfig):
    """Tokenize and pack once here: bad data fails before any process group, and ranks hit the cache."""
    from toolkit.data import load_tokenizer, prepare_data
    return prepare_data(cfg, load_tokenizer(cfg))


def _data_line(cfg: RunConfig, data) -> str:
    from toolkit.data.base import data_cache_dir
    evals = f", {len(data.eval)} eval rows" if data.eval is not None else ""
    return (f"# data: {cfg.data.path} - {data.num_documents} documents, {data.num_tokens} tokens -> "
            f"{len(data.train)} train rows of {cfg.data.seq_len} ({data.packing}){evals}; tokenized and packed "
            f"into {data_cache_dir(cfg)}, where the run reads them"
            + (f"; {data.num_identical_pairs} of {data.num_pairs} pairs dropped: their chosen and rejected answers "
               "are the same" if data.num_identical_pairs else ""))


def _launch(plan: Plan, nodes: Nodes, state) -> int:
    """Write what the launch decided (node 0: the old lineage set aside, run.json), config.yaml and
    plan.json, then run the ranks."""
    from toolkit.checkpoint.lineage import prepare_run_dir
    from toolkit.plan import write_plan
    cfg, run_dir = plan.config, Path(plan.config.run_dir)
    if nodes.node_rank == 0:  # node 0 owns the lineage; the run directory is shared by every node
        for line in prepare_run_dir(state):
            _say(line)
        for line in state.lines():
            _say(line)
    dump_config(cfg, run_dir / "config.yaml")  # for people; the ranks read the plan
    from toolkit.storage.rundir import VERIFIED_ENV
    verified = {VERIFIED_ENV: str(state.resume_from or "")}  # set either way: never an earlier launch's
    return _run_ranks(cfg, nodes, write_plan(plan, run_dir), verified)


def _say(line: str) -> None:
    print(f"toolkit: {line}", flush=True)


def _run_ranks(cfg: RunConfig, nodes: Nodes, plan_path: Path, env: dict[str, str]) -> int:
    from toolkit.launch.elastic import LaunchSpec
    from toolkit.watch.budgets import load_budget
    r = cfg.restart
    entrypoint, lead, preload = _rank_entrypoint(cfg)
    spec = LaunchSpec(nproc=cfg.nproc, run_dir=Path(cfg.run_dir), nnodes=nodes.nnodes, min_nnodes=_min_nnodes(nodes),
                      node_rank=nodes.node_rank, rdzv_endpoint=nodes.rdzv_endpoint, preload=preload,
                      max_restarts=r.max_restarts, backoff_s=r.backoff_s, hang_timeout_s=r.hang_timeout_s,
                      load_timeout_s=load_budget(plan_path), join_timeout_s=r.join_timeout_s)
    print(f"toolkit: {cfg.backend} on {cfg.nproc} rank(s) x {nodes.nnodes} node(s); run dir {cfg.run_dir}", flush=True)
    code = _run_supervised(spec, entrypoint, [*lead, str(plan_path)], env)
    if code == 0:
        print(done_line(cfg), flush=True)
    return code


def done_line(cfg: RunConfig) -> str:
    """What a finished run left, as it left it (no hf_final where train.export_hf=false)."""
    if not cfg.train.export_hf:
        model = ("no model written (train.export_hf=false, checkpoint.every=0)" if not cfg.checkpoint.every else
                 f"no hf_final (train.export_hf=false); the last checkpoint holds the model: toolkit convert "
                 f"{cfg.run_dir} DIR writes it as an HF model")
    else:
        model = f"model in {cfg.run_dir}/hf_final" + (f", LoRA adapter in {cfg.run_dir}/adapter" if cfg.lora.enabled
                                                       else "")
    return f"toolkit: done; metrics in {cfg.run_dir}/metrics.jsonl, {model}"


def _rank_entrypoint(cfg: RunConfig):
    """(entrypoint, leading args, forkserver preload). Without a GPU, ranks fork from a forkserver
    that imported the backend once (``toolkit.launch.elastic``); with one, or ``TOOLKIT_RANK_START=spawn``,
    each rank is ``python -u -m toolkit.train.worker`` (a process that may initialize CUDA is never
    forked: ``toolkit.launch.devices``)."""
    from toolkit.launch.devices import rank_start_method
    from toolkit.launch.elastic import python_module
    from toolkit.train.worker import preload_modules
    if rank_start_method() == "spawn":
        entrypoint, lead = python_module("toolkit.train.worker")
        return entrypoint, lead, ()
    return forked_main, [], preload_modules(cfg.backend)


def forked_main(plan_path: str, launcher_env: dict[str, str]) -> None:
    """A rank forked by the launcher's forkserver (``toolkit.launch.elastic``): the launcher's
    environment, then the worker's ``main`` (``python -m toolkit.train.worker`` otherwise)."""
    from toolkit.launch.elastic import adopt_launcher_env
    from toolkit.train.worker import main
    adopt_launcher_env(launcher_env)
    for stream in (sys.stdout, sys.stderr):  # as `python -u` for spawned ranks: lines appear as printed
        stream.reconfigure(line_buffering=True)
    code = main([plan_path])
    if code:
        sys.exit(code)  # the process's exit code, which the agent reads (REFUSED_EXIT: no restart)


def _run_supervised(spec, entrypoint, args: list[str], env: dict[str, str] | None = None) -> int:
    """Run under the agent; 0, PREEMPTED_EXIT (saved and stopped on request), or 1 (failed)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

    from toolkit.launch.elastic import launch_workers
    from toolkit.watch.events import emit
    from toolkit.watch.protocol import PREEMPTED_EXIT
    since = time.time()
    try:
        launch_workers(spec, entrypoint, args, env)
    except SignalException as exc:  # the launcher itself was told to stop and passed the signal on
        return _stopped_by(spec, exc.sigval)
    except RendezvousTimeoutError as exc:  # a node never joined: its name, not a traceback
        print(f"toolkit: {exc}", file=sys.stderr)
        return 1
    except ChildFailedError as exc:
        if getattr(exc, "refused", False):  # a rank refused the run (a config error): not retried
            raise ConfigError(_refusals(spec.run_dir, since)) from None
        if getattr(exc, "preempted", False):
            print("toolkit: preempted; a checkpoint was saved - run the same command to resume", file=sys.stderr)
            return PREEMPTED_EXIT
        emit(spec.run_dir, "gave_up", max_restarts=spec.max_restarts)
        print(f"toolkit: job failed after {spec.max_restarts} restart(s) allowed; events in "
              f"{spec.run_dir}/events.jsonl\n{exc.format_msg()}", file=sys.stderr)
        return 1
    return 0


def _refusals(run_dir: Path, since: float) -> str:
    """What the ranks that refused said (``refused`` events of this launch), once each."""
    from toolkit.watch.events import read_events
    said = [e["message"] for e in read_events(run_dir) if e.get("kind") == "refused" and e.get("time", 0) >= since]
    return "\n".join(dict.fromkeys(said)) or f"a rank refused the run; see {run_dir}/events.jsonl"


def _stopped_by(spec, sig) -> int:
    """The launcher was signalled and passed ``sig`` on to its ranks: a preemption signal made them save
    (PREEMPTED_EXIT); any other (SIGQUIT) ended them where they were, so say which checkpoint is left."""
    from toolkit.watch.events import emit
    from toolkit.watch.monitor import PREEMPT_SIGNALS
    from toolkit.watch.protocol import PREEMPTED_EXIT
    if sig in PREEMPT_SIGNALS:
        emit(spec.run_dir, "preempted", signal=sig.name, rank=None)
        print(f"toolkit: stopped by {sig.name}; ranks saved a checkpoint - run the same command to resume",
              file=sys.stderr)
        return PREEMPTED_EXIT
    emit(spec.run_dir, "stopped", signal=sig.name, rank=None)
    print(f"toolkit: stopped by {sig.name}, which ends the ranks without a save (SIGTERM, SIGINT or SIGHUP save "
          f"first); the same command resumes from the newest complete checkpoint in {spec.run_dir}/checkpoints",
          file=sys.stderr)
    return 1


def _min_nnodes(nodes: Nodes) -> int:
    return nodes.min_nnodes or nodes.nnodes

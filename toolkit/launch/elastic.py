"""Start N local ranks (or this node's share of a multi-node job) through torch's elastic agent.

This is the machinery behind torchrun (c10d rendezvous, worker monitoring, restarts), driven from
Python so that ``toolkit train`` needs no wrapper script; ``restart.agent.ToolkitAgent`` adds our
restart policy on top of it.
"""
from __future__ import annotations

import logging
import os
import socket
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

ELASTIC_WAIT_S = 10


@dataclass
class LaunchSpec:
    nproc: int
    run_dir: Path
    nnodes: int = 1
    min_nnodes: int | None = None  # below nnodes: elastic, continues on fewer nodes after a loss
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    run_id: str | None = None
    preload: tuple[str, ...] = ()  # modules the forkserver imports once when the entrypoint is a function
    max_restarts: int = 0
    backoff_s: float = 1.0
    hang_timeout_s: float = 0.0
    load_timeout_s: float | None = None  # watch ranks from their start (they beat while loading)
    join_timeout_s: float | None = None  # restart.join_timeout_s; None: roster.join_timeout_s's rule


def launch_workers(spec: LaunchSpec, entrypoint, args: list[str], env: dict[str, str] | None = None):
    """Run ``entrypoint *args`` on ``spec.nproc`` local ranks under the agent; raises ChildFailedError.
    ``entrypoint`` is a command (a program path, run with ``args``), or a module-level function that
    each rank calls with ``*args, launcher_env``: ranks then fork from a forkserver (see
    ``_start_method``), and ``launcher_env`` is this process's environment at launch, which the rank
    adopts (``adopt_launcher_env``): a forkserver keeps the environment it started with."""
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    from toolkit.launch.agent import ToolkitAgent
    from toolkit.launch.roster import Roster, join_timeout_s

    # torch's opt-out of sharing the rendezvous store with the ranks: with it shared, the store
    # outlives a restart and a plain script's new ranks can read the dead ranks' gloo addresses
    # (seen as "Connection refused" in connectFullMesh). Opted out, every attempt gets a fresh
    # store hosted by rank 0 on a free port, as with torchrun's static rendezvous.
    os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    _quiet_refusals()
    single_node = spec.nnodes == 1 and spec.rdzv_endpoint is None
    join_s = join_timeout_s(spec.nnodes, spec.join_timeout_s)
    rdzv = _rendezvous(spec, single_node, join_s)
    if not single_node and spec.node_rank > 0:
        _wait_for_rendezvous_host(spec.rdzv_endpoint, join_s)
    _set_worker_env(spec, env)
    rank_args = (*args, dict(os.environ)) if callable(entrypoint) else tuple(args)
    worker_spec = WorkerSpec(
        role="trainer", local_world_size=spec.nproc, entrypoint=entrypoint, args=rank_args,
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv), max_restarts=spec.max_restarts,
        monitor_interval=0.2, local_addr=rdzv.local_addr)
    roster = None
    if not single_node:  # the store listens now (node 0 made it with the handler): say we arrived
        roster = Roster(spec.nnodes, spec.node_rank, spec.rdzv_endpoint, join_s)
        roster.connect()
    agent = ToolkitAgent(spec=worker_spec, logs_specs=DefaultLogsSpecs(),
                         start_method=_start_method(entrypoint, spec.preload), run_dir=spec.run_dir,
                         max_restarts=spec.max_restarts, backoff_s=spec.backoff_s, hang_timeout_s=spec.hang_timeout_s,
                         load_timeout_s=spec.load_timeout_s, roster=roster)
    _run_agent(agent, worker_spec, entrypoint)


def _rendezvous(spec: LaunchSpec, single_node: bool, join_s: float):
    """torch's rendezvous parameters for this node of the job."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from toolkit.launch.roster import KEEP_ALIVE_MISSES, keep_alive_s, whole_seconds
    return RendezvousParameters(
        backend="c10d",
        # Like torchrun --standalone: a private store on a free loopback port.
        endpoint="127.0.0.1:0" if single_node else spec.rdzv_endpoint,
        run_id=spec.run_id or (uuid.uuid4().hex if single_node else "toolkit"),
        min_nodes=spec.min_nnodes or spec.nnodes, max_nodes=spec.nnodes,
        local_addr="127.0.0.1" if single_node else None,
        # After a node is lost, wait this long for it before continuing with the nodes present.
        last_call_timeout=ELASTIC_WAIT_S,
        # How long a node waits for the others (torch's default, 600 s, is sized for thousands of nodes).
        join_timeout=whole_seconds(join_s),
        # A lost node is dropped from the rendezvous after this many missed beats of this interval.
        keep_alive_interval=keep_alive_s(spec.nnodes), keep_alive_max_attempt=KEEP_ALIVE_MISSES,
        **({} if single_node else _multinode_rdzv_conf(spec.node_rank)))


def _run_agent(agent, worker_spec, entrypoint) -> None:
    """Run the agent to the job's end; a failed job raises ChildFailedError, marked preempted/refused."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    shutdown_rdzv = True
    try:
        result = agent.run()
        if result.is_failed():
            name = entrypoint.__qualname__ if callable(entrypoint) else Path(str(entrypoint)).name
            raise ChildFailedError(name=name, failures=result.failures)
    except ChildFailedError as exc:
        exc.preempted, exc.refused = agent.preempted, agent.refused
        raise
    except Exception as exc:
        # A signal to the agent must not close the rendezvous: other nodes may still use it.
        shutdown_rdzv = type(exc).__name__ != "SignalException"
        raise
    finally:
        if shutdown_rdzv:
            worker_spec.rdzv_handler.shutdown()


class _NoRefusalTraceback(logging.Filter):
    """torch logs every failed rank with the traceback of its own polling code; a rank that refused
    the run (``REFUSED_EXIT``) said why in a ``refused`` event, which the launcher prints once."""

    def filter(self, record: logging.LogRecord) -> bool:
        from toolkit.watch.protocol import REFUSED_EXIT
        return not (str(record.msg).startswith("failed (exitcode") and record.args
                    and record.args[0] == REFUSED_EXIT)


def _quiet_refusals() -> None:
    log = logging.getLogger("torch.distributed.elastic.multiprocessing.api")
    if not any(isinstance(f, _NoRefusalTraceback) for f in log.filters):
        log.addFilter(_NoRefusalTraceback())


def _multinode_rdzv_conf(node_rank: int) -> dict:
    """Node 0 hosts the rendezvous store; the others only ever connect to it.

    torch picks the host by hostname match and then by whoever binds the port first, so two agents
    on one machine (or a non-zero node that happens to share node 0's address) race for it. If the
    store lives with a node that is later lost, the survivors lose the rendezvous too, so the
    elastic guarantee holds only when node 0 hosts it, as the launch examples arrange.
    """
    return {"rank": node_rank, **({"is_host": False} if node_rank > 0 else {})}


def _wait_for_rendezvous_host(endpoint: str, timeout_s: float) -> None:
    """Wait until node 0's store listens (at most the join timeout: node 0 is a node that may never
    join). torch's store client retries a refused connection with a growing backoff, so a node that
    starts before node 0 could idle for a minute or more after it."""
    host, _, port = endpoint.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
            return
        except OSError as exc:
            if time.monotonic() > deadline:
                from torch.distributed.elastic.rendezvous import RendezvousTimeoutError
                raise RendezvousTimeoutError(
                    f"the rendezvous at {endpoint} did not answer in {timeout_s:.0f} s ({exc}): node 0, which "
                    "hosts it, never joined. Is node 0 running toolkit train with --node-rank 0 and this "
                    "--rdzv-endpoint, and is the port open between the nodes? To wait longer for slow "
                    "starts, raise restart.join_timeout_s") from None
            time.sleep(0.2)


def _set_worker_env(spec: LaunchSpec, env: dict[str, str] | None) -> None:
    """Environment the ranks inherit: our run dir, and the cores split between local ranks."""
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets 1 per rank; we split the cores
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // spec.nproc))
    os.environ["TOOLKIT_RUN_DIR"] = str(spec.run_dir)
    os.environ.update(env or {})


def _start_method(entrypoint, preload: tuple[str, ...]) -> str:
    """How the agent starts ranks. A command is spawned. A function runs in ranks forked from
    multiprocessing's forkserver: a clean interpreter (exec'd, no threads, no CUDA) that imports
    ``preload`` once, so each rank, and each restarted rank, starts with torch, transformers and the
    backend already imported instead of importing them itself (on 2 CPU cores: ~9 s of CPU per
    rank, a third of a tiny job's cost). The forkserver lives as long as this launcher."""
    if not callable(entrypoint):
        return "spawn"
    import multiprocessing
    multiprocessing.set_forkserver_preload(list(preload))
    return "forkserver"


AGENT_RANK_VARS = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK", "ROLE_NAME", "LOCAL_WORLD_SIZE", "WORLD_SIZE",
                   "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "TORCH_NCCL_ASYNC_ERROR_HANDLING", "CUDA_VISIBLE_DEVICES")
"""What torch's agent sets in each rank's environment (besides ``TORCHELASTIC_*``)."""


def adopt_launcher_env(launcher_env: dict[str, str]) -> None:
    """In a forked rank: the launcher's environment at launch, plus the variables torch's agent set
    for this rank. Without this a rank would see the forkserver's environment, which is the one of
    the first launch in this process (its TOOLKIT_FAULT, its run dir), not of this one. Variables a
    library read when the forkserver imported it keep their effect from then: OMP_NUM_THREADS is
    applied again here (torch sized its thread pool at import); HF_HOME and the like do not change
    within a launching program."""
    from_agent = {k: v for k, v in os.environ.items() if k in AGENT_RANK_VARS or k.startswith("TORCHELASTIC_")}
    os.environ.clear()
    os.environ.update(launcher_env)
    os.environ.update(from_agent)
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():
        import torch
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def python_module(module: str) -> tuple[str, list[str]]:
    """Entrypoint and leading args to run ``python -m module`` in each rank."""
    return sys.executable, ["-u", "-m", module]

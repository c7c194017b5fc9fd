"""torch elastic's LocalElasticAgent with our restart policy layered on its monitor loop.

The agent (the machinery of torchrun) starts the ranks, watches them and restarts the whole group
on a failure; we add: an event per failure/restart/hang/preemption in ``RUN_DIR/events.jsonl``,
exponential backoff between restarts, a heartbeat watchdog that judges each rank's silence against
its phase's budget (``watch/budgets.py``), dumps every rank's Python stack under a header naming
its phase and kills a hung job so that it restarts, and preemption (all ranks exiting with ``PREEMPTED_EXIT``)
ending the job instead of restarting it; a rank that refuses the run (``REFUSED_EXIT``: what a
config error makes it, ``train/worker.py``) ends it too: a restart would meet the same refusal.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from toolkit.watch.events import emit
from toolkit.watch.heartbeat import clear_heartbeats, read_heartbeats
from toolkit.watch.protocol import PREEMPTED_EXIT, REFUSED_EXIT, STACKS_DIR

# Frames that mean "waiting for the other ranks", not "stuck on its own".
_COLLECTIVE_FRAMES = ("distributed_c10d.py", "deepspeed/comm/", "torch/distributed/")


class ToolkitAgent(LocalElasticAgent):
    def __init__(self, *, run_dir: Path, max_restarts: int, backoff_s: float, hang_timeout_s: float,
                 load_timeout_s: float | None = None, roster=None, **kwargs):
        """``load_timeout_s``: watch ranks from their start, before their first beat (ranks that beat
        through their load: ``toolkit train``); each beat is judged by the budget it states.
        ``roster`` (multi-node, ``launch.roster.Roster``): names the nodes a timed-out rendezvous missed."""
        super().__init__(**kwargs)
        self.roster = roster
        self.run_dir = Path(run_dir)
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.hang_timeout_s, self.load_timeout_s = hang_timeout_s, load_timeout_s
        self._started, self._killed_as_hung = time.time(), False
        self._recovery: dict[str, float] = {}  # when the last failure was detected, and the restart's steps
        self.attempt = 0
        self._streak, self._failed_at = 0, None  # failures since the job last got past a failure's step
        self.preempted = False
        self.refused = False  # a rank exited REFUSED_EXIT: the job ends without a restart
        self._exits: dict[int, tuple[int, int]] = {}  # local rank -> (pid, exit code), this attempt

    # --- hooks into the agent's loop ---------------------------------------------------------------

    def _start_workers(self, worker_group: WorkerGroup):
        clear_heartbeats(self.run_dir)
        self._started, self._killed_as_hung = time.time(), False
        pids = super()._start_workers(worker_group)
        self._recovery["ranks_started"] = time.time()
        self._exits = {}
        if getattr(self._pcontext, "_pc", None) is not None:  # ranks run a function (forkserver)
            self._note_every_exit(self._pcontext._pc)
        return pids

    def _note_every_exit(self, pc) -> None:
        """torch's process context for function ranks reports only one failed rank (whichever of
        those already dead it looks at first: after a SIGKILL, often a peer that then failed in a
        collective); command ranks report all of them. Note every rank already exited with an
        error, just before each of torch's polls, so ``_monitor_workers`` reports them all."""
        import multiprocessing.connection
        join, exits = pc.join, self._exits

        def join_noting_exits(*args, **kwargs):
            for sentinel in multiprocessing.connection.wait(list(pc.sentinels), timeout=0):
                index = pc.sentinels[sentinel]
                process = pc.processes[index]
                if process.exitcode:
                    exits.setdefault(index, (process.pid, process.exitcode))
            return join(*args, **kwargs)
        pc.join = join_noting_exits

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        if result.state == WorkerState.HEALTHY:
            self._watch_for_hang(worker_group)
        elif result.state in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            if not self._killed_as_hung:  # a hang was detected when it was judged, not when its kill is seen
                self._recovery = {"detected": time.time()}
            self._add_noted_failures(worker_group, result)
            self._record_failure(result)
        return result

    def _stop_workers(self, worker_group: WorkerGroup) -> None:
        """Stop a failed group with SIGKILL: SIGTERM means "preempt: save and exit" to our ranks, and a
        rank blocked in a collective would sit out the timeout. Checkpoints are atomic, so nothing
        is lost. (A signal to the agent itself still reaches the ranks as that signal.)"""
        self._shutdown(death_sig=signal.SIGKILL, timeout=5)
        self._recovery["torn_down"] = time.time()

    def _rendezvous(self, worker_group: WorkerGroup) -> None:
        from torch.distributed.elastic.rendezvous import RendezvousTimeoutError
        started = time.monotonic()
        try:
            super()._rendezvous(worker_group)
        except RendezvousTimeoutError as exc:
            if self.roster is None:
                raise
            self._name_missing_nodes(worker_group, time.monotonic() - started, exc)
        self._recovery["rendezvous"] = time.time()

    def _name_missing_nodes(self, worker_group: WorkerGroup, waited_s: float, exc: Exception) -> None:
        """A ``rendezvous_timeout`` event and an error naming the nodes that never joined."""
        from torch.distributed.elastic.rendezvous import RendezvousTimeoutError

        from toolkit.launch.roster import participants
        handler = worker_group.spec.rdzv_handler
        present = participants(handler)
        min_nodes = handler.settings.min_nodes if hasattr(handler, "settings") else self.roster.nnodes
        never, gone, joined = self.roster.absent(present)
        emit(self.run_dir, "rendezvous_timeout", node_rank=self.roster.node_rank, nnodes=self.roster.nnodes,
             min_nodes=min_nodes, never_arrived=never, lost=gone, joined=joined, waited_s=round(waited_s, 2),
             join_timeout_s=self.roster.timeout_s)
        raise RendezvousTimeoutError(self.roster.timed_out(present, min_nodes)) from exc

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        self.attempt += 1
        delay = restart_delay(self.backoff_s, self._streak)
        emit(self.run_dir, "restart", attempt=self.attempt, delay_s=delay,
             restarts_left=self._remaining_restarts, max_restarts=self.max_restarts)
        time.sleep(delay)
        self._recovery["backoff"] = time.time()
        super()._restart_workers(worker_group)
        self._emit_restart_timeline()

    def _emit_restart_timeline(self) -> None:
        """``restarted``: seconds from the failure's detection to the end of the backoff, the ranks
        torn down, the rendezvous closed and the ranks started (the ranks add theirs to ``recovered``:
        ``Trainer._note_recovery``)."""
        marks = self._recovery
        if "detected" not in marks:
            return
        emit(self.run_dir, "restarted", attempt=self.attempt, detected_at=marks["detected"],
             **{f"{step}_s": round(marks[step] - marks["detected"], 3)
                for step in ("backoff", "torn_down", "rendezvous", "ranks_started") if step in marks})

    # --- failures ----------------------------------------------------------------------------------

    def _add_noted_failures(self, worker_group: WorkerGroup, result: RunResult) -> None:
        from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
        for local_rank, (pid, code) in self._exits.items():
            global_rank = worker_group.workers[local_rank].global_rank
            if global_rank not in result.failures:
                result.failures[global_rank] = ProcessFailure(local_rank=local_rank, pid=pid, exitcode=code,
                                                              error_file=self._pcontext.error_files[local_rank])

    def _record_failure(self, result: RunResult) -> None:
        codes = {rank: f.exitcode for rank, f in result.failures.items()}
        if REFUSED_EXIT in codes.values():  # the rank said why in a `refused` event; nothing to retry
            self.refused, self._remaining_restarts = True, 0
            return
        self.preempted = _is_preemption(codes)
        beats = read_heartbeats(self.run_dir)
        reached = max((b["step"] for b in beats.values() if b.get("step") is not None), default=None)
        self._streak, self._failed_at = failure_streak(self._streak, self._failed_at, reached)
        for rank, failure in sorted(result.failures.items()):
            emit(self.run_dir, "preempted" if self.preempted else "failure", rank=rank,
                 exit_code=failure.exitcode, signal=_signal_name(failure.exitcode),
                 step=beats.get(rank, {}).get("step"), restarts_left=self._remaining_restarts)
        if self.preempted:
            self._remaining_restarts = 0  # a requested stop is not a crash: end the job, resumable

    # --- hangs -------------------------------------------------------------------------------------

    def _watch_for_hang(self, worker_group: WorkerGroup) -> None:
        if not self.hang_timeout_s or self._pcontext is None or self._killed_as_hung:
            return  # (killed: until torch's monitor sees the exits, the old beats would read as a second hang)
        local = [w.global_rank for w in worker_group.workers]
        hang = find_hang(read_heartbeats(self.run_dir), local, time.time(), self._started,
                         self.hang_timeout_s, self.load_timeout_s)
        if hang is None:
            return
        self._recovery = {"detected": time.time()}
        stacks = self._dump_stacks(worker_group, hang)
        stuck = [r for r, text in stacks.items() if text and not _waiting_in_collective(text)]
        stuck = stuck or [min(hang, key=lambda r: hang[r]["time"])]
        phases = sorted({hang[r]["phase"] for r in stuck if r in hang} or {b["phase"] for b in hang.values()})
        steps = [b["step"] for b in hang.values() if b.get("step") is not None]
        emit(self.run_dir, "hang", stuck_ranks=sorted(stuck), step=min(steps, default=None), phase=",".join(phases),
             phases={r: b["phase"] for r, b in sorted(hang.items())},
             seconds_without_progress=round(time.time() - max(b["time"] for b in hang.values()), 1),
             budgets_s={r: b["budget_s"] for r, b in sorted(hang.items())}, stacks=str(self.run_dir / STACKS_DIR))
        self._killed_as_hung = True
        for pid in self._pcontext.pids().values():
            _kill(pid, signal.SIGKILL)  # the next monitor pass sees the failure and restarts

    def _dump_stacks(self, worker_group: WorkerGroup, hang: dict[int, dict]) -> dict[int, str]:
        """Ask every rank for its Python stacks (faulthandler on SIGUSR2, registered first thing by
        each rank: ``watch.monitor.register_stack_dump``), each dump headed by the rank's phase."""
        paths = {w.global_rank: self.run_dir / STACKS_DIR / f"rank_{w.global_rank:05d}.txt"
                 for w in worker_group.workers}
        (self.run_dir / STACKS_DIR).mkdir(parents=True, exist_ok=True)
        for rank, path in paths.items():
            with open(path, "a") as f:
                f.write(_stack_header(rank, hang.get(rank), self.attempt))
        offsets = {r: p.stat().st_size for r, p in paths.items()}
        for pid in self._pcontext.pids().values():
            _kill(pid, signal.SIGUSR2)
        time.sleep(1.0)
        stacks = {}
        for rank, path in paths.items():  # the files accumulate across attempts: read this dump only
            with open(path) as f:
                f.seek(offsets[rank])
                stacks[rank] = f.read()
        return stacks


def find_hang(beats: dict[int, dict], local_ranks: list[int], now: float, started: float,
              default_budget_s: float, load_timeout_s: float | None) -> dict[int, dict] | None:
    """Every watched rank's beat (with its ``budget_s``) when all of them are silent beyond their
    phase's budget, else None.

    Watched: every rank that has beaten (on any node: the run directory is shared), and, when
    ``load_timeout_s`` is given (``toolkit train``), every local rank from its start: one that has
    not beaten yet is in ``load`` since ``started``. A plain script under ``toolkit supervise`` is
    watched once it beats. The job is hung only when no rank progresses: a rank waiting in a
    collective for a peer that writes alone (rank 0's export, a slow shard) is silent but not stuck,
    and a stuck rank soon leaves every peer waiting on it."""
    watched = {r: {**b, "budget_s": b.get("budget_s", default_budget_s)} for r, b in beats.items()}
    if load_timeout_s is not None:
        for rank in local_ranks:
            watched.setdefault(rank, {"rank": rank, "step": None, "phase": "load", "time": started,
                                      "budget_s": load_timeout_s})
    if not watched or any(now - b["time"] <= b["budget_s"] for b in watched.values()):
        return None
    return watched


MAX_BACKOFF_S = 30.0


def restart_delay(backoff_s: float, streak: int) -> float:
    """Seconds before restart number ``streak`` of a crash loop: ``backoff_s`` doubling, at most 30 s."""
    return min(MAX_BACKOFF_S, backoff_s * 2 ** max(streak - 1, 0))


def failure_streak(streak: int, failed_at: int | None, reached: int | None) -> tuple[int, int | None]:
    """(streak, step) after a failure at step ``reached``: a job that got past the step of its previous
    failure made progress, so its backoff starts over (only a loop failing at the same place keeps
    doubling it; a long job's 7th unrelated fault must not wait the cap)."""
    progressed = reached is not None and failed_at is not None and reached > failed_at
    return (1 if progressed else streak + 1), reached if reached is not None else failed_at


def _stack_header(rank: int, beat: dict | None, attempt: int) -> str:
    if beat is None:
        return f"\n=== hang watchdog, attempt {attempt}: rank {rank} (no heartbeat seen) ===\n"
    return (f"\n=== hang watchdog, attempt {attempt}: rank {rank} silent in phase {beat['phase']!r} "
            f"(step {beat.get('step')}, budget {beat['budget_s']} s) ===\n")


def _waiting_in_collective(stacks: str) -> bool:
    """Whether a rank's dumped main thread waits in a collective. Only its own frames count: a rank
    forked by the launcher has torch elastic's and multiprocessing's wrappers at the bottom of every
    stack (``torch/distributed/elastic/...``), which would make every rank look like a waiter."""
    current = stacks.split("Current thread", 1)[-1]  # faulthandler: the thread that took the signal
    frames = [line for line in current.splitlines() if line.strip().startswith("File ")]
    own = []
    for frame in frames:  # most recent call first: stop at the launcher's wrappers
        if "torch/distributed/elastic/" in frame or "/multiprocessing/" in frame:
            break
        own.append(frame)
    return any(marker in frame for frame in own for marker in _COLLECTIVE_FRAMES)


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _signal_name(exitcode: int) -> str | None:
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return str(-exitcode)
    return None


def _is_preemption(codes: dict[int, int]) -> bool:
    """A rank exits PREEMPTED_EXIT only after the collective save committed, so one such rank means
    the job saved and stopped on request; the others either exited the same way or were still
    tearing down when the agent stopped the group (SIGTERM/SIGKILL)."""
    stopped_by_agent = {-signal.SIGTERM, -signal.SIGKILL}
    return PREEMPTED_EXIT in codes.values() and all(c == PREEMPTED_EXIT or c in stopped_by_agent
                                                    for c in codes.values())


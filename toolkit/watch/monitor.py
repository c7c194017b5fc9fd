"""Per-rank health checks run by the trainer at step boundaries.

- heartbeat: every step, for the agent's hang watchdog; stacks on SIGUSR2 (faulthandler);
- preemption: SIGTERM/SIGINT/SIGHUP/SIGUSR1 (``PREEMPT_SIGNALS``) set a flag; ranks agree on it
  (max all-reduce) so all stop at the same step boundary, save, and exit with PREEMPTED_EXIT (SIGINT: a Ctrl-C, which the launcher
  passes on to its ranks, saves as a scheduler's SIGTERM does, rather than raise KeyboardInterrupt;
  SIGHUP: the launcher's terminal or ssh session went away, which the launcher passes on too);
- stragglers: every N steps, per-rank busy time (data + forward) is gathered; a rank slower than
  factor x the median of its peers is named in events.jsonl and the log;
- divergence: every N steps, a checksum of the parameters that must be identical on DP replicas is
  gathered; a mismatch is an error event naming the ranks, and the job fails (then restarts from a
  consistent checkpoint) rather than drifting silently.
"""
from __future__ import annotations

import faulthandler
import signal
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit import device
from toolkit.config import RestartConfig
from toolkit.watch.events import emit
from toolkit.watch.heartbeat import Heartbeat
from toolkit.watch.protocol import STACKS_DIR

# Signals a rank answers by saving at the next step boundary and exiting PREEMPTED_EXIT. The launcher
# passes SIGTERM, SIGINT and SIGHUP on to its ranks; SIGQUIT it passes too, and that one ends them unsaved.
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


class DivergenceError(RuntimeError):
    pass


_stack_files: dict[Path, object] = {}  # kept open: faulthandler writes to its descriptor from a signal handler


def register_stack_dump(run_dir: Path, rank: int) -> None:
    """Python stacks of every thread to ``RUN_DIR/stacks/rank_XXXXX.txt`` on SIGUSR2 (the hang
    watchdog's request); first thing in a rank, so a hang while loading is dumped too (SIGUSR2's
    default action would kill the rank without a word). Once per file and process."""
    path = Path(run_dir) / STACKS_DIR / f"rank_{rank:05d}.txt"
    if path in _stack_files:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    _stack_files[path] = open(path, "a")  # kept across restarts
    faulthandler.register(signal.SIGUSR2, file=_stack_files[path], all_threads=True)


class RankMonitor:
    def __init__(self, run_dir: Path, policy: RestartConfig, log=print, heartbeat: Heartbeat | None = None):
        """``heartbeat``: the rank's, when it has beaten since its start (``train.worker``)."""
        self.run_dir, self.policy, self.log = Path(run_dir), policy, log
        self.rank = dist.get_rank()
        self.heartbeat = heartbeat or Heartbeat(run_dir, self.rank)
        self._stop_requested = False
        self._busy_s = 0.0
        register_stack_dump(self.run_dir, self.rank)
        for sig in PREEMPT_SIGNALS:
            signal.signal(sig, self._request_stop)

    def _request_stop(self, signum, frame) -> None:
        self._stop_requested = True

    def add_busy(self, seconds: float) -> None:
        self._busy_s += seconds

    def stop_agreed(self) -> bool:
        """True on every rank if any rank was asked to stop (one tiny all-reduce per step)."""
        flag = device.tensor([int(self._stop_requested)], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def check_stragglers(self, step: int) -> None:
        every = self.policy.straggler_every
        if not every or step % every or dist.get_world_size() < 2:
            return
        times = [None] * dist.get_world_size()
        dist.all_gather_object(times, self._busy_s / every)
        self._busy_s = 0.0
        for rank, t in enumerate(times):
            peers = statistics.median(x for r, x in enumerate(times) if r != rank)
            slow = t > self.policy.straggler_factor * peers and t - peers > self.policy.straggler_min_gap_s
            if slow and self.rank == 0:
                emit(self.run_dir, "straggler", rank=rank, step=step, busy_s_per_step=round(t, 4),
                     peers_median_s=round(peers, 4), factor=round(t / peers, 2))
                self.log(f"straggler: rank {rank} took {t:.3f}s/step vs {peers:.3f}s for its peers (step {step})")

    def check_divergence(self, step: int, engine) -> None:
        every = self.policy.divergence_every
        if not every or step % every:
            return
        value = engine.replica_checksum()
        if value is None:  # parameters are sharded (ZeRO-3): nothing is replicated to compare
            return
        # (global rank, checksum) from each replica, so the event names ranks a user can find in the
        # logs, and the lowest rank of the replica group reports (rank 0 may be in another group).
        sums = [None] * engine.dp_size
        dist.all_gather_object(sums, (self.rank, value), group=engine.dp_group)
        if len({s for _, s in sums}) > 1:
            groups: dict[float, list[int]] = {}
            for rank, s in sums:
                groups.setdefault(s, []).append(rank)
            if self.rank == min(rank for rank, _ in sums):
                emit(self.run_dir, "divergence", step=step, replica_groups=list(groups.values()))
            raise DivergenceError(f"step {step}: data-parallel replicas hold different parameters; ranks grouped "
                                  f"by identical checksums: {list(groups.values())}")

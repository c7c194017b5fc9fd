"""Per-rank heartbeats (``RUN_DIR/heartbeat/rank_XXXXX.json``) read by the agent's hang watchdog.

A beat says what the rank is doing (its phase, ``PHASES``) and how long it may stay silent in it
(``budget_s``, from ``toolkit.watch.budgets``). Long work beats as it progresses (per eval batch, per
checkpoint file, per exported tensor: ``Heartbeat.progress``), never from a timer thread, which
would beat on through a real hang.

Any training script can beat: ``toolkit.watch.heartbeat.beat(step)`` finds the run directory and
rank from the environment ``toolkit supervise`` sets.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

HEARTBEAT_DIR = "heartbeat"
PHASES = ("load", "reshard", "ready", "step", "eval", "save", "export")
"""load: process group, data, engine build and resume; reshard: converting a checkpoint written at
another layout; ready: resumed, before the first step; step: training (beaten per step); eval, save,
export: the long work at step boundaries and at the end."""
PROGRESS_EVERY_S = 0.2  # progress beats closer than this are skipped (a file write per tensor costs)


class Heartbeat:
    def __init__(self, run_dir: Path | str, rank: int, budgets: dict[str, float] | None = None):
        """``budgets``: the longest silence allowed per phase (``watch.budgets.phase_budgets``);
        without one, the agent judges a beat by ``restart.hang_timeout_s``."""
        self.dir = Path(run_dir) / HEARTBEAT_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank_{rank:05d}.json"
        self.rank, self.budgets = rank, budgets or {}
        self.started_at = time.time()  # made first thing in a rank: when the rank came up
        self.marks: dict[str, float] = {}  # stage of the rank's start -> when it was done (recovery time)
        self.step, self.phase, self._last = None, None, 0.0

    def beat(self, step: int | None, phase: str = "step") -> None:
        """Atomic replace of a tiny file: the watchdog never reads half a beat."""
        if phase not in PHASES:
            raise ValueError(f"heartbeat phase {phase!r} is not one of {PHASES}")
        self.step, self.phase, self._last = step, phase, time.monotonic()
        record = {"rank": self.rank, "step": step, "phase": phase, "time": time.time(), "pid": os.getpid()}
        if phase in self.budgets:
            record["budget_s"] = self.budgets[phase]
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.path)

    def mark(self, stage: str) -> None:
        """A stage of the rank's start is done (process group, data, engine): note when, and beat."""
        self.marks[stage] = time.time()
        self.progress()

    def progress(self) -> None:
        """A unit of the current phase's work is done (a tensor, a file, a batch): beat again."""
        if self.phase is not None and time.monotonic() - self._last >= PROGRESS_EVERY_S:
            self.beat(self.step, self.phase)


_default: Heartbeat | None = None


def beat(step: int, phase: str = "step") -> None:
    """Heartbeat for scripts under ``toolkit supervise`` (no-op outside it)."""
    global _default
    run_dir = os.environ.get("TOOLKIT_RUN_DIR")
    if run_dir is None:
        return
    if _default is None:
        _default = Heartbeat(run_dir, int(os.environ.get("RANK", "0")))
    _default.beat(step, phase)


def read_heartbeats(run_dir: Path | str) -> dict[int, dict]:
    beats = {}
    for path in (Path(run_dir) / HEARTBEAT_DIR).glob("rank_*.json"):
        try:
            beat_ = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # replaced while reading; the next poll sees it
        beats[beat_["rank"]] = beat_
    return beats


def clear_heartbeats(run_dir: Path | str) -> None:
    for path in (Path(run_dir) / HEARTBEAT_DIR).glob("rank_*.json"):
        path.unlink(missing_ok=True)

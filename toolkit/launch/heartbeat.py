"""Per-rank heartbeats (``RUN_DIR/heartbeat/rank_XXXXX.json``) read by the agent's hang watchdog.

Any training script can beat: ``toolkit.launch.heartbeat.beat(step)`` finds the run directory and
rank from the environment ``toolkit supervise`` sets.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

HEARTBEAT_DIR = "heartbeat"


class Heartbeat:
    def __init__(self, run_dir: Path | str, rank: int):
        self.dir = Path(run_dir) / HEARTBEAT_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / f"rank_{rank:05d}.json"
        self.rank = rank

    def beat(self, step: int, phase: str = "step") -> None:
        """Atomic replace of a tiny file: the watchdog never reads half a beat."""
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rank": self.rank, "step": step, "phase": phase, "time": time.time(),
                                   "pid": os.getpid()}))
        os.replace(tmp, self.path)


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

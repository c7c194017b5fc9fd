"""``RUN_DIR/events.jsonl``: one JSON object per failure, restart, hang, preemption, resume."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

EVENTS_FILE = "events.jsonl"


def emit(run_dir: Path | str, kind: str, **fields) -> dict:
    """Append one event durably (O_APPEND keeps lines whole when several processes write)."""
    event = {"time": round(time.time(), 3), "kind": kind, **fields}
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(run_dir) / EVENTS_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(event) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return event


def read_events(run_dir: Path | str) -> list[dict]:
    path = Path(run_dir) / EVENTS_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line] if path.exists() else []

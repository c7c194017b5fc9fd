"""Rank 0's view of a run: metrics.jsonl, a rich progress bar (plain lines off a TTY), TensorBoard."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, enabled: bool, log_every: int = 10):
        self.enabled = enabled
        self.total = total_steps
        self.log_every = log_every
        self.path = Path(run_dir) / METRICS_FILE
        self._file = None
        self._progress = self._task = self._tb = None

    def __enter__(self):
        if not self.enabled:
            return self
        self._file = open(self.path, "a", buffering=1)
        if sys.stdout.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
            self._progress = Progress(TextColumn("step {task.completed}/{task.total}"), BarColumn(),
                                      TextColumn("{task.fields[status]}"), TimeElapsedColumn(),
                                      TimeRemainingColumn())
            self._progress.start()
            self._task = self._progress.add_task("train", total=self.total, status="")
        self._tb = _tensorboard_writer(self.path.parent / "tensorboard")
        return self

    def __exit__(self, *exc):
        if self._progress:
            self._progress.stop()
        if self._tb:
            self._tb.close()
        if self._file:
            self._file.close()
            self._file = None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record = {**record, "time": round(time.time(), 3)}
        line = json.dumps(record)
        if self._file:
            self._file.write(line + "\n")
        else:  # outside the loop (e.g. resume before fit's context): append directly
            with open(self.path, "a") as f:
                f.write(line + "\n")
        if self._tb and "step" in record:
            for key, value in record.items():
                if key not in ("step", "time") and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])
        self._show(record)

    def _show(self, r: dict) -> None:
        if "loss" in r:
            status = f"loss {r['loss']:.4f} lr {r['lr']:.2e} {r['tokens_per_s']:.0f} tok/s"
            if self._progress:
                self._progress.update(self._task, completed=r["step"], status=status)
            elif r["step"] == 1 or r["step"] % self.log_every == 0 or r["step"] == self.total:
                print(f"step {r['step']}/{self.total} {status} grad_norm {r['grad_norm']:.3f}", flush=True)
        elif "eval_loss" in r:
            self.note(f"step {r['step']}: eval_loss {r['eval_loss']:.4f}")

    def note(self, message: str) -> None:
        if not self.enabled:
            return
        if self._progress:
            self._progress.console.print(message)
        else:
            print(message, flush=True)


def _tensorboard_writer(path: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is an optional extra
        return None
    return SummaryWriter(str(path))


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """The last training record per step (a resumed run appends; the newest line wins)."""
    records: dict[int, dict] = {}
    path = Path(run_dir) / METRICS_FILE
    for line in path.read_text().splitlines() if path.exists() else []:
        r = json.loads(line)
        if "loss" in r:
            records[r["step"]] = r
    return records

"""Rank 0's view of a run: metrics.jsonl, a rich progress bar (plain lines off a TTY), TensorBoard,
and Weights & Biases when a project is configured."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

METRICS_FILE = "metrics.jsonl"


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, enabled: bool, log_every: int = 10,
                 wandb_project: str | None = None, run_config: dict | None = None):
        self.enabled = enabled
        self.wandb_project, self.run_config = wandb_project, run_config or {}
        self._wandb = None
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
        if self.wandb_project:
            self._wandb = _wandb_run(self.wandb_project, self.path.parent, self.run_config)
        return self

    def __exit__(self, *exc):
        if self._progress:
            self._progress.stop()
        if self._tb:
            self._tb.close()
        if self._wandb:
            self._wandb.finish()
            self._wandb = None
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
        scalars = {k: v for k, v in record.items() if k not in ("step", "time") and isinstance(v, (int, float))}
        if self._tb and "step" in record:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, record["step"])
        if self._wandb and "step" in record:
            self._wandb.log(scalars, step=record["step"])
        self._show(record)

    def _show(self, r: dict) -> None:
        if "loss" in r:
            status = f"loss {r['loss']:.4f} lr {r['lr']:.2e} {r['tokens_per_s']:.0f} tok/s"
            if self._progress:
                self._progress.update(self._task, completed=r["step"], status=status)
            elif r["step"] == 1 or r["step"] % self.log_every == 0 or r["step"] == self.total or r.get("skipped"):
                norm = (f"grad_norm {r['grad_norm']:.3f}" if r["grad_norm"] is not None else
                        f"skipped (fp16 overflow; loss scale now {r.get('loss_scale')})")
                print(f"step {r['step']}/{self.total} {status} {norm}", flush=True)
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


def wandb_missing() -> str | None:
    try:
        import wandb  # noqa: F401
    except ImportError:
        return ("metrics.wandb_project is set but wandb is not installed: pip install 'toolkit[wandb]' "
                "(or unset metrics.wandb_project)")
    return None


def _wandb_run(project: str, run_dir: Path, config: dict):
    """One W&B run per run directory: a restarted or resumed job appends to the same run."""
    import hashlib

    import wandb
    run_id = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
    return wandb.init(project=project, dir=str(run_dir), id=run_id, resume="allow", name=Path(run_dir).name,
                      config=config)

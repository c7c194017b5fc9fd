"""Crash-consistent checkpoints: staging directory, fsync, checksum manifest, COMPLETE marker, rename.

A checkpoint directory (``RUN_DIR/checkpoints/step_XXXXXXXX``) holds:
  engine/          the backend's own files (DeepSpeed: latest + global_stepN/)
  trainer/rank_XXXXX.pt   per-rank RNG state (loads with weights_only=True)
  trainer.json     step, consumed samples, tokens
  meta.json        format, family, layout, step, vocab size, versions
  config.json      the HF model config (so any reader knows the architecture)
  manifest.json    {relative path: {"bytes", "sha256"}} of every file above
  COMPLETE         written last; a directory without it is never loaded
It is built under ``.staging-step_XXXXXXXX`` and renamed into place only when whole, and
``checkpoints/latest`` is replaced atomically after that, so a crash at any instant leaves either the
previous checkpoint or the new one, never a half-written directory that a resume would pick up.
"""
from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from toolkit.storage import (
    COMPLETE,
    LATEST,
    MANIFEST,
    build_manifest,
    fsync,
    newest_complete,
    write_json_durable,
    write_text_atomic,
)


class CheckpointError(RuntimeError):
    pass


class SaveFailed(CheckpointError):
    """A checkpoint that some rank could not write (or persist); it was never committed.
    ``errors``: each rank's error (None where that rank's part was written)."""

    def __init__(self, step: int, errors: list[str | None]):
        self.step, self.errors = step, errors
        failed = "; ".join(f"rank {rank}: {e}" for rank, e in enumerate(errors) if e)
        super().__init__(f"checkpoint step {step} could not be written ({failed})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def describe_error(exc: BaseException) -> str:
    """An error as a line, led by its errno's name when it has one (``ENOSPC: ...``: a full disk)."""
    code = getattr(exc, "errno", None)
    return f"{errno.errorcode.get(code, code)}: {exc}" if code else repr(exc)


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int):
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def staging(self, step: int) -> Path:
        return self.root / f".staging-{step_dir_name(step)}"

    def begin(self, step: int) -> Path:
        """Fresh staging directory for ``step`` (rank 0 only; others wait on a barrier)."""
        stage = self.staging(step)
        if stage.exists():
            shutil.rmtree(stage)  # left by a crash during an earlier save of this step
        stage.mkdir(parents=True)
        return stage

    def commit(self, step: int, manifest: dict | None = None) -> Path:
        """Manifest, COMPLETE, rename, latest, retention (rank 0, after every rank wrote its files).

        ``manifest``: entries already computed while the files were written (asynchronous saves
        hash and fsync as they copy); by default every staged file is hashed and fsynced here."""
        stage = self.staging(step)
        write_json_durable(stage / MANIFEST, manifest or build_manifest(stage))
        write_json_durable(stage / COMPLETE, {"step": step})
        final = self.root / step_dir_name(step)
        if final.exists():  # an older save of the same step (e.g. after a resume): replace it whole
            shutil.rmtree(final)
        os.replace(stage, final)
        fsync(self.root)
        write_text_atomic(self.root / LATEST, final.name)
        self._apply_retention()
        return final

    def committed(self) -> list[Path]:
        """Committed checkpoints (COMPLETE written), oldest first; not verified."""
        return sorted(p for p in self.root.glob("step_*") if (p / COMPLETE).exists())

    def _apply_retention(self) -> None:
        complete = self.committed()
        for old in complete[:-self.keep_last] if self.keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


def find_latest_complete(run_dir: Path, log=print) -> Path | None:
    """Newest checkpoint of a run that verifies; broken ones are reported and skipped, never deleted."""
    return newest_complete(Path(run_dir) / "checkpoints", log=log)


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
meta.json records the run id of the run that wrote it (``storage/rundir.py``): retention counts only
this run's checkpoints, and a damaged (or another run's) checkpoint that a new save of its step would
replace is moved to ``RUN_DIR/set_aside/`` instead of deleted.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from toolkit.storage import (
    COMPLETE,
    LATEST,
    MANIFEST,
    build_manifest,
    fsync,
    verify_complete,
    write_json_durable,
    write_text_atomic,
)
from toolkit.storage.rundir import newest_of_lineage, other_lineage, set_aside


class CheckpointError(RuntimeError):
    pass


class SaveFailed(CheckpointError):
    """A checkpoint that some rank could not write (or persist); it was never committed.
    ``errors``: each rank's error (None where that rank's part was written); ``full``: where a rank
    that failed found its disk full (``storage.space.looks_full``), by rank."""

    def __init__(self, step: int, errors: list[str | None], full: dict[int, str] | None = None):
        self.step, self.errors, self.full = step, errors, full or {}
        failed = "; ".join(f"rank {rank}: {e}" for rank, e in enumerate(errors) if e)
        super().__init__(f"checkpoint step {step} could not be written ({failed})")


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


class CheckpointManager:
    def __init__(self, run_dir: Path, keep_last: int, run_id: str | None = None, log=print):
        """``run_id``: the run whose checkpoints retention counts (None: every checkpoint)."""
        self.run_dir, self.root = Path(run_dir), Path(run_dir) / "checkpoints"
        self.keep_last, self.run_id, self.log = keep_last, run_id, log

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
        if final.exists():
            self._replace(final)
        os.replace(stage, final)
        fsync(self.root)
        write_text_atomic(self.root / LATEST, final.name)
        self._apply_retention()
        return final

    def _replace(self, final: Path) -> None:
        """An earlier save of this step is in the way. A whole checkpoint of this run (saved again
        after a resume from it) goes; one a resume passed over (damaged, or another run's) is moved
        aside, never deleted."""
        if not verify_complete(final) and other_lineage(final, self.run_id) is None:
            shutil.rmtree(final)
            return
        moved = set_aside(self.run_dir, final)
        self.log(f"{final.name} was damaged or another run's; the new save of its step replaces it, and it was moved "
                 f"to {moved} (nothing was deleted)")

    def committed(self) -> list[Path]:
        """This run's committed checkpoints (COMPLETE written), oldest first; not verified."""
        return sorted(p for p in self.root.glob("step_*")
                      if (p / COMPLETE).exists() and other_lineage(p, self.run_id) is None)

    def _apply_retention(self) -> None:
        complete = self.committed()
        for old in complete[:-self.keep_last] if self.keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


def find_latest_complete(run_dir: Path, log=print, run_id: str | None = None) -> Path | None:
    """Newest checkpoint of a run that verifies (of run ``run_id``'s, when given); broken ones (and other
    runs') are reported and skipped, never deleted."""
    return newest_of_lineage(Path(run_dir), run_id, log=log)


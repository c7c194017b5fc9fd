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

import hashlib
import json
import os
import shutil
from pathlib import Path

MANIFEST, COMPLETE, LATEST = "manifest.json", "COMPLETE", "latest"


class CheckpointError(RuntimeError):
    pass


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


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
        _fsync(self.root)
        write_text_atomic(self.root / LATEST, final.name)
        self._apply_retention()
        return final

    def _apply_retention(self) -> None:
        complete = sorted(p for p in self.root.glob("step_*") if (p / COMPLETE).exists())
        for old in complete[:-self.keep_last] if self.keep_last > 0 else []:
            shutil.rmtree(old, ignore_errors=True)


def build_manifest(root: Path) -> dict:
    """``{"files": {relative path: {"bytes", "sha256"}}}`` of every file under ``root``, each fsynced.
    The fsyncs run in a second thread while this one hashes: one waits on the disk, the other reads
    the page cache (a 536 MB conversion output on 2 busy cores: 0.8-1.0 s instead of 1.2-1.4 s)."""
    from concurrent.futures import ThreadPoolExecutor
    paths = [p for p in sorted(root.rglob("*")) if p.is_file() and str(p.relative_to(root)) not in (MANIFEST, COMPLETE)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        synced = [pool.submit(_fsync, p) for p in paths]
        files = {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in paths}
        for done in synced:
            done.result()  # an fsync's error is the build's error
    return {"files": files}


def verify_checkpoint(ckpt: Path, checksums: bool = True) -> list[str]:
    """Problems found in a checkpoint directory ([] when it is complete and intact)."""
    if not (ckpt / COMPLETE).exists():
        return [f"{ckpt}: no {COMPLETE} marker (the save did not finish)"]
    try:
        manifest = json.loads((ckpt / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        return [f"{ckpt}: unreadable {MANIFEST} ({exc})"]
    problems = []
    for rel, entry in manifest.items():
        path = ckpt / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.stat().st_size != entry["bytes"]:
            problems.append(f"{rel}: {path.stat().st_size} bytes, manifest says {entry['bytes']} (truncated?)")
        elif checksums and sha256_file(path) != entry["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest (corrupted)")
    return problems


def find_latest_complete(run_dir: Path, log=print) -> Path | None:
    """Newest checkpoint that verifies; broken ones are reported and skipped, never deleted."""
    root = Path(run_dir) / "checkpoints"
    for ckpt in sorted(root.glob("step_*"), reverse=True):
        problems = verify_checkpoint(ckpt)
        if not problems:
            return ckpt
        log(f"skipping checkpoint {ckpt.name}: " + "; ".join(problems[:3]))
    return None


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json_durable(path: Path, obj) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2, sort_keys=True))


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(path.parent)


def _fsync(path: Path) -> None:
    """fsync a file or a directory (the latter makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

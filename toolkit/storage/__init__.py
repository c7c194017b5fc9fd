"""Durable, self-describing directories: what checkpoints and conversion outputs share.

A directory is built in a staging folder, every file fsynced, described by ``manifest.json``
(``{"files": {relative path: {"bytes", "sha256"}}}``) and marked ``COMPLETE`` last; it is renamed
into place only when whole. A reader verifies the manifest before trusting the contents. Both the
checkpoint manager (``toolkit/checkpoint``) and the converter (``toolkit/convert``) build on this
module, which imports neither.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from pathlib import Path

MANIFEST, COMPLETE, LATEST = "manifest.json", "COMPLETE", "latest"
PLAIN_TAG = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
"""A checkpoint tag a ``latest`` pointer may name: one folder name (``global_step6``, ``step_00000006``),
never a path (``../x``, ``/abs``, ``a/b``)."""


class UnsafeTag(ValueError):
    """A ``latest`` pointer naming something other than a folder beside it."""


def read_tag(pointer: Path) -> str:
    """The tag a ``latest`` file names, refused unless it is a plain folder name: a pointer is never
    followed out of its checkpoint."""
    tag = Path(pointer).read_text().strip()
    if not PLAIN_TAG.fullmatch(tag) or ".." in tag:
        raise UnsafeTag(f"{pointer} names {tag[:200]!r}, which is not a plain checkpoint tag (a folder name such as "
                        "global_step6 beside it): refusing to follow it out of the checkpoint; write the tag's "
                        "folder name into it, or convert an intact copy")
    return tag


def build_manifest(root: Path) -> dict:
    """``{"files": {relative path: {"bytes", "sha256"}}}`` of every file under ``root``, each fsynced.
    The fsyncs run in a second thread while this one hashes: one waits on the disk, the other reads
    the page cache (a 536 MB conversion output on 2 busy cores: 0.8-1.0 s instead of 1.2-1.4 s)."""
    from concurrent.futures import ThreadPoolExecutor
    paths = [p for p in sorted(root.rglob("*")) if p.is_file() and str(p.relative_to(root)) not in (MANIFEST, COMPLETE)]
    with ThreadPoolExecutor(max_workers=1) as pool:
        synced = [pool.submit(fsync, p) for p in paths]
        files = {str(p.relative_to(root)): {"bytes": p.stat().st_size, "sha256": sha256_file(p)} for p in paths}
        for done in synced:
            done.result()  # an fsync's error is the build's error
    return {"files": files}


def verify_complete(ckpt: Path, checksums: bool = True) -> list[str]:
    """Problems found in a durable directory ([] when it is complete and matches its manifest)."""
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


def newest_complete(root: Path, pattern: str = "step_*", log=print, skip=None,
                    verified: Path | None = None) -> Path | None:
    """Newest directory under ``root`` matching ``pattern`` that verifies; broken ones are reported
    and skipped, never deleted. ``skip(candidate)``: a reason to pass a candidate over unread
    (another run's checkpoint: ``storage/rundir.py``), or None. ``verified``: a directory whose
    checksums were just verified (by the launcher, which holds the run directory): only its marker
    and sizes are checked again, not every byte a second time."""
    for candidate in sorted(Path(root).glob(pattern), reverse=True):
        reason = skip(candidate) if skip else None
        if reason:
            log(f"skipping checkpoint {candidate.name}: {reason}")
            continue
        problems = verify_complete(candidate, checksums=verified is None or candidate != Path(verified))
        if not problems:
            return candidate
        log(f"skipping checkpoint {candidate.name}: " + "; ".join(problems[:3]))
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
    """``path`` replaced whole. Each writer has its own temporary file: several processes (every
    node's agent writing RUN_DIR/plan.json on a shared filesystem) may write at once, the last
    rename wins and no reader sees a partial file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the file from the run's other readers
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync(path.parent)


def fsync(path: Path) -> None:
    """fsync a file or a directory (the latter makes renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

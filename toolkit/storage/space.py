"""Free space, full disks and the filesystem's refusals, said the same way by every command.

A full disk is recognized however the writer words it: Python's own writes raise ``OSError(ENOSPC)``,
but torch's zip writer raises ``RuntimeError('[enforce fail at inline_container.cc:672] . unexpected
pos 576 vs 534')`` (measured on a full tmpfs and on /dev/full), with no errno at all. So a failed write
is judged by the free space left where it wrote, not only by its message.
"""
from __future__ import annotations

import errno
import shutil
from pathlib import Path

LOW_SPACE_BYTES = 64 << 20
"""Below this much free space a disk counts as full whatever was being written: a failed write with
less room than this left is never worth a "what went wrong" hunt."""

FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)

PATH_ERRNOS = {
    errno.EROFS: "choose a path on a writable filesystem",
    errno.EACCES: "choose a path you may write, or fix its permissions",
    errno.EPERM: "choose a path you may write, or fix its permissions",
    errno.ENOSPC: "free space there, or choose another disk",
    errno.EDQUOT: "free space there (your quota), or choose another disk",
    errno.ENOENT: "check the path",
    errno.ENOTDIR: "a part of the path is a file, not a directory: check the path",
    errno.EISDIR: "a directory stands where a file should be: check the path",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.EFBIG: "the file outgrew what the filesystem (or this process's limit) allows: choose another disk",
    errno.EIO: "the disk or the network filesystem failed: check it, then run again",
}
"""The filesystem's refusals a command reports as one message with the path (exit 2), and what to
do about each."""


def existing_ancestor(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where a new file under ``path`` would land)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> int | None:
    """Bytes an unprivileged writer may still use on ``path``'s filesystem (None when unknown)."""
    try:
        return shutil.disk_usage(existing_ancestor(path)).free
    except OSError:
        return None


def looks_full(exc: BaseException | None, path: Path, needed: int = 0) -> bool:
    """Whether a write under ``path`` that failed with ``exc`` ran out of room: its errno says so, or
    less than ``needed`` bytes (at least ``LOW_SPACE_BYTES``) are left there. Call it before the
    failed write's partial output is removed."""
    if getattr(exc, "errno", None) in FULL_ERRNOS:
        return True
    free = free_bytes(path)
    return free is not None and free < max(needed, LOW_SPACE_BYTES)


def describe_error(exc: BaseException) -> str:
    """An error as a line, led by its errno's name when it has one (``ENOSPC: ...``: a full disk)."""
    code = getattr(exc, "errno", None)
    return f"{errno.errorcode.get(code, code)}: {exc}" if code else repr(exc)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def path_error(exc: OSError) -> str | None:
    """One line for an OS error about a path (``/x/y: read-only file system (EROFS): choose a
    writable path``), or None when it is not one (no path, or an errno that says nothing of the path)."""
    if exc.errno not in PATH_ERRNOS or not exc.filename:
        return None
    name = errno.errorcode.get(exc.errno, str(exc.errno))
    where = f"{exc.filename} -> {exc.filename2}" if exc.filename2 else str(exc.filename)
    return f"{where}: {(exc.strerror or name).lower()} ({name}); {PATH_ERRNOS[exc.errno]}"

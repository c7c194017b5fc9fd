"""Real filesystems that refuse: a read-only folder and a small disk that fills up, for the tests
of what each command says when the disk says no (not a mocked errno: the wording the writers really
produce, torch's zip writer included).

As root (CI on this machine) both are mounts: a read-only bind mount and a tmpfs of a given size.
Without root, a read-only folder is a folder without write permission (EACCES instead of EROFS: the
same one message); a small disk needs a mount, so those tests run where root is (skipped elsewhere,
failed in CI, as the container tests are)."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path

import pytest


def can_mount() -> bool:
    return os.geteuid() == 0


def _mount(*args: str) -> None:
    proc = subprocess.run(["mount", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"mount {' '.join(args)} failed: {proc.stderr.strip()}")


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


@contextlib.contextmanager
def read_only(path: Path):
    """``path`` (a folder, made if missing) read-only for this process while the block runs."""
    path.mkdir(parents=True, exist_ok=True)
    if can_mount():
        _mount("--bind", "-o", "ro", str(path), str(path))
        try:
            yield path
        finally:
            _umount(path)
        return
    mode = path.stat().st_mode
    path.chmod(0o555)
    try:
        yield path
    finally:
        path.chmod(mode)


@contextlib.contextmanager
def small_disk(path: Path, size_bytes: int):
    """A fresh filesystem of ``size_bytes`` mounted on ``path`` while the block runs."""
    if not can_mount():
        reason = "a small filesystem needs a tmpfs mount (root)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"cannot run in CI: {reason}")
        pytest.skip(reason)
    path.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path))
    try:
        yield path
    finally:
        _umount(path)

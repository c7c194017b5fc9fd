"""Asynchronous checkpoints: block only for a write to node-local storage, persist in the background.

A save with ``checkpoint.async_save`` writes the engine's files, the RNG states and the descriptions
into ``LOCAL/step_XXXXXXXX`` on each node (``checkpoint.local_dir``: /dev/shm or a local disk), and
training goes on. The node's local rank 0 then copies that snapshot into the run directory's staging
folder in a thread, hashing and fsyncing each file as it goes. At every step boundary the ranks ask
each other (one small all-reduce, only while a save is in flight) whether every node has finished;
when all have, global rank 0 commits exactly as a synchronous save does (manifest, COMPLETE, rename,
``latest``, retention). So the crash guarantees are unchanged: a checkpoint whose persist did not
finish has no COMPLETE marker and is never loaded, and a resume takes the newest committed one.

The snapshot is consistent because the engine wrote it at the step boundary, before the next step
changed anything; the background thread only copies finished files and never touches a tensor.
At most one save is in flight: the next save, the end of training and a preemption wait for it.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit import device
from toolkit.checkpoint.manager import CheckpointManager, SaveFailed, step_dir_name
from toolkit.storage import fsync
from toolkit.storage.space import describe_error, free_bytes, human_bytes, looks_full

COPY_CHUNK = 1 << 22


def default_local_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(os.environ.get("TMPDIR", "/tmp"))


def local_root(local_dir: str | None, run_dir: Path) -> Path:
    """This run's folder on node-local storage (two runs on one node never share one)."""
    key = hashlib.sha1(str(Path(run_dir).resolve()).encode()).hexdigest()[:12]
    return Path(local_dir or default_local_dir()) / f"toolkit-ckpt-{key}"


def persist_tree(src: Path, dst: Path, on_file=None) -> dict:
    """Copy every file of ``src`` into ``dst``: hashed while copied, fsynced; the manifest entries."""
    entries = {}
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        rel = str(path.relative_to(src))
        target = dst / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        entries[rel] = _copy_hashed(path, target)
        if on_file is not None:
            on_file(rel)
    for folder in {dst, *(p for p in dst.rglob("*") if p.is_dir())}:
        fsync(folder)
    return entries


def _copy_hashed(src: Path, dst: Path) -> dict:
    h, size = hashlib.sha256(), 0
    with open(src, "rb") as fin, open(dst, "wb") as fout:
        while block := fin.read(COPY_CHUNK):
            h.update(block)
            fout.write(block)
            size += len(block)
        fout.flush()
        os.fsync(fout.fileno())
    return {"bytes": size, "sha256": h.hexdigest()}


class AsyncCheckpointer:
    """One per rank; ``start`` after the snapshot is written, ``poll`` at step boundaries."""

    def __init__(self, manager: CheckpointManager, root: Path, local_rank: int, log=print, on_file=None):
        self.manager, self.root, self.log = manager, Path(root), log
        self.is_persister = local_rank == 0
        self.on_file = on_file  # called in the thread after each persisted file (fault injection)
        self.pending: int | None = None
        self._thread: threading.Thread | None = None
        self._entries: dict = {}
        self._error: BaseException | None = None
        self._full: str | None = None  # where the failed persist found its disk full
        self._started = 0.0

    def clear_stale(self) -> None:
        """Drop snapshots a killed run left on this node (collective)."""
        if self.is_persister and self.root.exists():
            shutil.rmtree(self.root, ignore_errors=True)
        dist.barrier()

    def snapshot_dir(self, step: int) -> Path:
        return self.root / step_dir_name(step)

    def has_room(self, need_bytes: float) -> bool:
        """Whether every node's local storage can take a snapshot (collective: all ranks agree)."""
        self.root.parent.mkdir(parents=True, exist_ok=True)
        need = need_bytes * 1.1
        ok = device.tensor([int(shutil.disk_usage(self.root.parent).free >= need)], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())

    def start(self, step: int) -> None:
        """Every rank has written its files into the snapshot (the caller's barrier): persist them."""
        self.pending, self._entries, self._error = step, {}, None
        self._started = time.perf_counter()
        if self.is_persister:
            self._thread = threading.Thread(target=self._persist, args=(step,), name=f"persist-{step}",
                                            daemon=True)
            self._thread.start()

    def _persist(self, step: int) -> None:
        src, dst = self.snapshot_dir(step), self.manager.staging(step)
        try:
            self._entries = persist_tree(src, dst, self.on_file)
            shutil.rmtree(src, ignore_errors=True)
        except BaseException as exc:  # reported to every rank by the next poll
            self._error = exc
            snapshot_bytes = sum(f.stat().st_size for f in src.rglob("*") if f.is_file())
            if looks_full(exc, dst, needed=snapshot_bytes):  # measured before the partial copy goes
                free = free_bytes(dst)
                self._full = f"{dst.parent} ({human_bytes(free) if free is not None else 'unknown'} free)"

    def poll(self, wait: bool = False) -> Path | None:
        """Commit the save in flight if every node has persisted it (collective); the committed dir."""
        while self.pending is not None:
            if wait and self._thread is not None:
                self._thread.join()
            busy = int(self._thread is not None and self._thread.is_alive())
            state = device.tensor([busy, int(self._error is not None)], dtype=torch.int32)
            dist.all_reduce(state, op=dist.ReduceOp.MAX)
            if state[1]:
                self._fail()
            if not state[0]:
                return self._commit()
            if not wait:
                return None
            time.sleep(0.05)
        return None

    def _fail(self) -> None:
        """Some node's persist failed: every rank learns each one's error (collective) and raises."""
        step, error = self.pending, self._error
        self.pending, self._thread = None, None
        shutil.rmtree(self.snapshot_dir(step), ignore_errors=True)
        outcomes = [None] * dist.get_world_size()
        dist.all_gather_object(outcomes, (f"background persist failed: {describe_error(error)}", self._full)
                               if error else None)
        self._full = None
        raise SaveFailed(step, [o and o[0] for o in outcomes],
                         {rank: o[1] for rank, o in enumerate(outcomes) if o and o[1]})

    def _commit(self) -> Path | None:
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self._entries)
        step, final = self.pending, None
        if dist.get_rank() == 0:
            files = {rel: entry for part in gathered for rel, entry in (part or {}).items()}
            final = self.manager.commit(step, manifest={"files": files})
            self.log(f"persisted checkpoint {final.name} in the background "
                     f"({time.perf_counter() - self._started:.2f} s after the step went on)")
        self.pending, self._thread = None, None
        return final

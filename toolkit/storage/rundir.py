"""A run directory's owner and lineage: one writer at a time, one run's checkpoints at a time.

- ``RUN_DIR/run.lock``: ``toolkit train`` holds an exclusive ``flock`` on it for the whole job, its
  restarts included, taken before it writes anything there; inside, a small JSON holder record
  (host, pid, since). A second launch finds the lock held and refuses, naming the holder. The kernel
  drops a lock whose process died, so a record left behind by a killed launcher is stale: the next
  launch takes the lock over and says whose it was. Each node of a multi-node job locks its own file
  (``run.node<N>.lock``; node 0 keeps ``run.lock``), so a second job on the same run directory is
  refused on every node where the filesystem's locks reach.
- ``RUN_DIR/run.json``: ``{"run_id", "created"}``, the lineage this run directory continues. Every
  checkpoint records the run id of the run that wrote it (meta.json ``run_id``), and a resume reads
  only checkpoints of its own lineage (or ones recording none: older toolkits and ``toolkit
  convert`` outputs). ``--resume never`` starts a new lineage.
- ``RUN_DIR/set_aside/<UTC time>/``: what a command moved out of the way instead of deleting it
  (the old lineage's checkpoints on ``--resume never``; a damaged checkpoint a new save replaced).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from toolkit.config import ConfigError
from toolkit.storage import fsync, newest_complete, write_json_durable
from toolkit.storage.meta import read_meta

LOCK_FILE, RUN_RECORD, SET_ASIDE, CHECKPOINTS = "run.lock", "run.json", "set_aside", "checkpoints"
VERIFIED_ENV = "TOOLKIT_VERIFIED_CHECKPOINT"
"""The checkpoint the launcher verified byte for byte before starting the ranks (which it resumes):
their first attempt checks its marker and sizes only (a restart verifies every byte again)."""
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)
"""What ``flock`` raises on a filesystem without locks (Lustre mounted without ``-o flock``, some NFS)."""


class RunDirError(ConfigError):
    """A run directory a command refuses to use as it is: the message says why and what to do;
    nothing was written."""


class RunDirBusy(RunDirError):
    """Another launch holds the run directory's lock."""


def lock_name(node_rank: int = 0) -> str:
    return LOCK_FILE if node_rank == 0 else f"run.node{node_rank}.lock"


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a run directory's lock."""
    host: str
    pid: int
    since: float
    pid_start: str | None = None  # the process's start time (/proc), so a reused pid is not taken for it

    @classmethod
    def this_process(cls) -> Holder:
        return cls(socket.gethostname(), os.getpid(), round(time.time(), 3), _process_start(os.getpid()))

    @classmethod
    def parse(cls, text: str) -> Holder | None:
        try:
            record = json.loads(text)
            return cls(str(record["host"]), int(record["pid"]), float(record["since"]), record.get("pid_start"))
        except (ValueError, KeyError, TypeError):
            return None

    def describe(self) -> str:
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(self.since))
        minutes = max(0.0, time.time() - self.since) / 60
        return f"pid {self.pid} on {self.host} since {when} ({minutes:.0f} min ago)"

    def gone(self) -> bool | None:
        """Whether the process is gone: None when it ran on another host (its liveness is unknowable here)."""
        if self.host != socket.gethostname():
            return None
        start = _process_start(self.pid)
        if start is None:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                return False
            return not Path("/proc").is_dir()  # /proc shows every live pid: no start time means no process
        return self.pid_start is not None and start != self.pid_start


def _process_start(pid: int) -> str | None:
    """A process's start time in clock ticks since boot (``/proc/PID/stat`` field 22); None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return fields[19] if len(fields) > 19 else None


class RunDirLock:
    """The exclusive lock of one node of a job on ``run_dir``. ``acquire`` creates what it needs
    (the directory, the lock file) and remembers it, so that ``release(undo=True)`` after a refusal
    leaves the run directory exactly as it was."""

    def __init__(self, run_dir: Path, node_rank: int = 0):
        self.run_dir, self.path = Path(run_dir), Path(run_dir) / lock_name(node_rank)
        self._fd: int | None = None
        self._created: list[Path] = []
        self._previous: bytes | None = None  # the lock file's bytes before this holder wrote its record

    def acquire(self) -> str | None:
        """Take the lock or raise ``RunDirBusy`` naming the holder; ``RunDirError`` when the run
        directory cannot be written. Returns a line to show when it took over a dead holder's
        lock, or when this filesystem has no locks."""
        try:
            return self._acquire()
        except BaseException:
            self.release(undo=True)
            self._undo_created()  # (release does nothing when no lock was taken)
            raise

    def _acquire(self) -> str | None:
        self._make_dirs()
        note = None
        while self._fd is None:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = Holder.parse(_read(fd))
                os.close(fd)
                raise RunDirBusy(_busy_message(self.run_dir, self.path, holder)) from None
            except OSError as exc:
                if exc.errno not in NO_FLOCK:
                    os.close(fd)
                    raise
                note = (f"{self.run_dir} is on a filesystem without file locks (flock: "
                        f"{errno.errorcode.get(exc.errno)}): only the holder record in {self.path.name} guards it "
                        "against a second launch here, and not against one started at the same instant")
            if not _same_file(fd, self.path):  # unlinked by a refused launch's undo between our open and lock
                os.close(fd)
                continue
            self._fd = fd
        self._previous = _read(self._fd).encode()
        holder = Holder.parse(self._previous.decode(errors="replace"))
        if holder is not None:
            note = note or self._take_over(holder)
        _rewrite(self._fd, json.dumps(asdict(Holder.this_process())) + "\n")
        return note

    def _take_over(self, holder: Holder) -> str | None:
        """The lock was free, yet a record is left: its launcher died without releasing it."""
        if holder.host == socket.gethostname() and holder.pid == os.getpid():
            return None  # an earlier launch of this process (the Python API) left it
        if holder.gone() is False:  # alive on this host, yet not holding it: its lock file was replaced
            os.close(self._fd)
            self._fd = None
            raise RunDirBusy(_busy_message(self.run_dir, self.path, holder, replaced=True))
        return (f"{self.path} was left by {holder.describe()}, which no longer holds it (killed, or its machine "
                "restarted): taking the lock over")

    def release(self, undo: bool = False) -> None:
        """Give the lock up. The record is cleared (a record left behind means a launcher died);
        ``undo``: the run directory goes back to how ``acquire`` found it (the lock file's old
        bytes, or no lock file and no directories it created)."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            if undo and self._created_file():
                self.path.unlink(missing_ok=True)  # before the unlock: a racing launch re-checks the inode
            else:
                _rewrite(fd, (self._previous or b"").decode() if undo else "")
        finally:
            os.close(fd)
        if undo:
            self._undo_created()

    def _undo_created(self) -> None:
        """Remove what ``acquire`` created (deepest first), unless something else is in it now."""
        for made in reversed(self._created):
            try:
                made.unlink(missing_ok=True) if made == self.path else made.rmdir()
            except OSError:
                break  # in use now, or gone: keep it and its parents
        self._created = []

    def _created_file(self) -> bool:
        return self.path in self._created

    def _make_dirs(self) -> None:
        missing = []
        cur = self.run_dir.absolute()
        while not cur.exists() and cur != cur.parent:
            missing.append(cur)
            cur = cur.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue
            except OSError as exc:
                raise RunDirError(_unwritable(self.run_dir, exc)) from None
            self._created.append(d)

    def _open(self) -> int:
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            self._created.append(self.path)
            return fd
        except FileExistsError:
            pass
        except OSError as exc:
            raise RunDirError(_unwritable(self.run_dir, exc)) from None
        try:
            return os.open(self.path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:  # removed since: create it on the next try
            return self._open()
        except OSError as exc:
            raise RunDirError(_unwritable(self.run_dir, exc)) from None


def lock_holder(run_dir: Path, node_rank: int = 0) -> Holder | None:
    """Who holds the lock now (a dry run's look, which writes nothing), or None when it is free.
    A record whose holder released the lock, or died, is not a holder."""
    path = Path(run_dir) / lock_name(node_rank)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        return Holder.parse(_read(fd)) or Holder("", 0, os.fstat(fd).st_mtime)  # held, its record not written yet
    except OSError:
        return None  # no locks on this filesystem: nothing to see
    finally:
        os.close(fd)


def busy_message(run_dir: Path, node_rank: int, holder: Holder) -> str:
    return _busy_message(Path(run_dir), Path(run_dir) / lock_name(node_rank), holder)


def _busy_message(run_dir: Path, path: Path, holder: Holder | None, replaced: bool = False) -> str:
    known = holder is not None and holder.pid > 0
    who = holder.describe() if known else "a process that wrote no record"
    stop = (f"kill -TERM {holder.pid}" + ("" if holder.host == socket.gethostname() else f" on {holder.host}")
            if known else "stop it")
    if replaced:
        return (f"run dir {run_dir} is in use by {who}, although {path} is not locked: it was removed or "
                f"replaced while that launch ran. Wait for that run to finish or stop it ({stop}), or use "
                "another --run-dir")
    return (f"run dir {run_dir} is in use by another toolkit train: {who} holds {path}. One launch writes a run "
            f"directory at a time: wait for that run to finish, stop it ({stop}: it saves a checkpoint and the "
            "same command resumes it), or use another --run-dir")


def _unwritable(run_dir: Path, exc: OSError) -> str:
    from toolkit.storage.space import path_error
    return f"run dir {run_dir} cannot be written: " + (path_error(exc) or str(exc))


def _read(fd: int) -> str:
    return os.pread(fd, 1 << 16, 0).decode(errors="replace")


def _rewrite(fd: int, text: str) -> None:
    os.ftruncate(fd, 0)
    os.pwrite(fd, text.encode(), 0)
    os.fsync(fd)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (os.fstat(fd).st_dev, os.fstat(fd).st_ino)


# --- lineage -----------------------------------------------------------------------------------------

def new_run_id() -> str:
    """A run id: UTC start time (sorts by age) and a random suffix (unique across machines)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + uuid.uuid4().hex[:8]


def read_run_id(run_dir: Path) -> str | None:
    try:
        return json.loads((Path(run_dir) / RUN_RECORD).read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def write_run_id(run_dir: Path, run_id: str) -> None:
    write_json_durable(Path(run_dir) / RUN_RECORD, {"run_id": run_id, "created": time.time()})


def checkpoint_run_id(ckpt: Path) -> str | None:
    """The run id a checkpoint's meta.json records (None: none recorded, or unreadable)."""
    try:
        return read_meta(ckpt).get("run_id")
    except (OSError, ValueError, AttributeError):
        return None


def step_dirs(run_dir: Path) -> list[Path]:
    """Every ``step_*`` directory of a run, newest first, whatever its state."""
    return sorted((p for p in (Path(run_dir) / CHECKPOINTS).glob("step_*") if p.is_dir()), reverse=True)


def lineage_of(run_dir: Path) -> str | None:
    """The run id a run directory continues: run.json's, else the newest checkpoint's that records one."""
    return read_run_id(run_dir) or next(filter(None, map(checkpoint_run_id, step_dirs(run_dir))), None)


def other_lineage(ckpt: Path, run_id: str | None) -> str | None:
    """Why ``ckpt`` is not this run's (None when it is, or records no run id)."""
    theirs = checkpoint_run_id(ckpt)
    if run_id is None or theirs is None or theirs == run_id:
        return None
    return f"written by run {theirs}, not by this run directory's run {run_id} (run.json)"


def newest_of_lineage(run_dir: Path, run_id: str | None, log=print, verified: Path | None = None) -> Path | None:
    """The newest checkpoint of ``run_id``'s lineage that verifies (checkpoints recording no run id
    count as its own); others are reported and skipped, never deleted. ``verified``: as
    ``storage.newest_complete``'s."""
    def skip(ckpt: Path) -> str | None:
        return other_lineage(ckpt, run_id)
    return newest_complete(Path(run_dir) / CHECKPOINTS, log=log, skip=skip, verified=verified)


def set_aside(run_dir: Path, path: Path, stamp: str | None = None) -> Path:
    """Move ``path`` into ``RUN_DIR/set_aside/<UTC time>/`` (never deleted: a person decides);
    returns where it went."""
    stamp = stamp or time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    folder = Path(run_dir) / SET_ASIDE / stamp
    folder.mkdir(parents=True, exist_ok=True)
    dest, n = folder / path.name, 1
    while dest.exists():
        n += 1
        dest = folder / f"{path.name}.{n}"
    os.replace(path, dest)
    fsync(folder)
    fsync(path.parent)
    return dest


class Claim:
    """A launch's hold on its run directory (``claim_run_dir``): refusals before ``keep()`` leave the
    run directory as it was found; after it, the launch owns what it writes there."""

    def __init__(self, lock: RunDirLock | None):
        self.lock, self.kept = lock, False

    def keep(self) -> None:
        self.kept = True


@contextlib.contextmanager
def claim_run_dir(run_dir: Path, node_rank: int = 0, dry_run: bool = False, say=print):
    """Hold ``run_dir``'s lock for the ``with`` block, taken before anything is written there (a second
    launch is refused at once, naming this one). ``dry_run``: only look (a held lock refuses as the
    launch would; nothing is written). ``say``: how a taken-over lock is reported."""
    if dry_run:
        holder = lock_holder(run_dir, node_rank)
        if holder is not None:
            raise RunDirBusy(busy_message(run_dir, node_rank, holder))
        yield Claim(None)
        return
    lock = RunDirLock(run_dir, node_rank)
    note = lock.acquire()
    if note:
        say(note)
    claim = Claim(lock)
    try:
        yield claim
    finally:
        lock.release(undo=not claim.kept)


def check_writable(run_dir: Path) -> None:
    """Refuse a run directory (or, when it does not exist yet, the folder it would be made in) that
    this process cannot write, or whose files it appends to it cannot write, before anything starts."""
    from toolkit.storage.space import existing_ancestor
    run_dir = Path(run_dir)
    targets = [existing_ancestor(run_dir)]
    targets += [run_dir / name for name in (CHECKPOINTS, "metrics.jsonl", "events.jsonl") if (run_dir / name).exists()]
    for target in targets:
        if not os.access(target, os.W_OK | (os.X_OK if target.is_dir() else 0)):
            code = errno.EROFS if _read_only_fs(target) else errno.EACCES
            raise RunDirError(_unwritable(run_dir, OSError(code, os.strerror(code), str(target))))


def _read_only_fs(path: Path) -> bool:
    try:
        return bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    except OSError:
        return False

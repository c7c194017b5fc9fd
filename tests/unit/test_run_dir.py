"""A run directory's owner and lineage without a job (``storage/rundir.py``, ``checkpoint/lineage.py``):
the lock refuses a second holder and names the first, takes a dead holder's over and says so, and
leaves the run directory as it found it after a refusal; a resume reads only its own run's
checkpoints, refuses when every one is damaged (deleting none), and a save over a damaged checkpoint
moves it aside; ``latest`` pointers are never followed out of a checkpoint; full disks are known by
the room left, whatever the writer said."""
from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from toolkit.checkpoint.lineage import resume_checkpoint
from toolkit.checkpoint.manager import CheckpointManager
from toolkit.storage import UnsafeTag, read_tag
from toolkit.storage.rundir import (
    LOCK_FILE,
    Holder,
    RunDirBusy,
    RunDirError,
    RunDirLock,
    claim_run_dir,
    lock_holder,
    write_run_id,
)
from toolkit.storage.space import looks_full, path_error


def test_a_held_lock_refuses_a_second_holder_naming_the_first(tmp_path):
    first = RunDirLock(tmp_path / "run")
    assert first.acquire() is None
    with pytest.raises(RunDirBusy) as busy:
        RunDirLock(tmp_path / "run").acquire()  # flock: another open file, even in this process
    assert f"pid {os.getpid()} on {socket.gethostname()} since" in str(busy.value)
    assert "--run-dir" in str(busy.value) and f"kill -TERM {os.getpid()}" in str(busy.value)
    assert lock_holder(tmp_path / "run").pid == os.getpid()  # what a dry run sees, writing nothing
    first.release()
    assert (tmp_path / "run" / LOCK_FILE).read_text() == "" and lock_holder(tmp_path / "run") is None
    second = RunDirLock(tmp_path / "run")
    assert second.acquire() is None  # released cleanly: nothing to take over
    second.release()


def test_a_dead_holders_lock_is_taken_over_and_said(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": dead.pid, "since": 1.0e9}))
    lock = RunDirLock(tmp_path)
    note = lock.acquire()
    assert note and f"pid {dead.pid} on {socket.gethostname()}" in note and "taking the lock over" in note
    assert Holder.parse((tmp_path / LOCK_FILE).read_text()).pid == os.getpid()
    lock.release()


def test_a_reused_pid_is_not_taken_for_the_holder(tmp_path):
    """pid 1 lives, but it is not the process that wrote the record (another start time)."""
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "since": 1.0e9,
                                                  "pid_start": "-1"}))
    lock = RunDirLock(tmp_path)
    assert "pid 1 " in lock.acquire()
    lock.release()


def test_a_live_holder_whose_lock_file_was_replaced_still_refuses(tmp_path):
    """The record names a live process of this host with its start time, yet the file is not locked:
    someone removed the lock file under a running launch. Taking it would make two writers."""
    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        record = Holder(socket.gethostname(), alive.pid, 1.0e9, Holder.this_process().pid_start)
        start = open(f"/proc/{alive.pid}/stat").read().rpartition(")")[2].split()[19]
        (tmp_path / LOCK_FILE).write_text(json.dumps({**record.__dict__, "pid_start": start}))
        with pytest.raises(RunDirBusy, match=f"in use by pid {alive.pid} .* is not locked: it was removed"):
            RunDirLock(tmp_path).acquire()
    finally:
        alive.kill()
        alive.wait()


def test_a_refusal_leaves_the_run_dir_as_it_was(tmp_path):
    new = tmp_path / "a" / "b" / "run"
    with pytest.raises(RunDirError, match="refused"):
        with claim_run_dir(new):
            assert Holder.parse((new / LOCK_FILE).read_text()).pid == os.getpid()
            raise RunDirError("refused")
    assert not (tmp_path / "a").exists()  # every folder the claim made is gone
    old = tmp_path / "old"
    old.mkdir()
    (old / LOCK_FILE).write_text("left by an earlier launch\n")
    with pytest.raises(RunDirError):
        with claim_run_dir(old, say=lambda line: None):
            raise RunDirError("refused")
    assert (old / LOCK_FILE).read_text() == "left by an earlier launch\n"
    with claim_run_dir(old, say=lambda line: None) as claim:
        claim.keep()
    assert (old / LOCK_FILE).read_text() == ""  # kept and released: the lock file stays, unheld


def _checkpoint(mgr: CheckpointManager, step: int, run_id: str | None):
    stage = mgr.begin(step)
    (stage / "engine").mkdir()
    (stage / "engine" / "weights.bin").write_bytes(bytes(range(100)))
    (stage / "meta.json").write_text(json.dumps({"step": step, **({"run_id": run_id} if run_id else {})}))
    return mgr.commit(step)


def _flip(ckpt) -> None:
    weights = ckpt / "engine" / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[3] ^= 1
    weights.write_bytes(bytes(data))


def test_a_resume_reads_only_its_own_runs_checkpoints(tmp_path):
    """Run B's step 2 after run A's step 4 (what --resume never used to leave): B resumes step 2.
    A checkpoint recording no run (an older toolkit's, a conversion) counts as its own."""
    mgr = CheckpointManager(tmp_path, keep_last=5)
    _checkpoint(mgr, 4, "run-a")
    _checkpoint(mgr, 2, "run-b")
    _checkpoint(mgr, 1, None)
    write_run_id(tmp_path, "run-b")
    said = []
    assert resume_checkpoint(tmp_path, "run-b", log=said.append).name == "step_00000002"
    assert said == ["skipping checkpoint step_00000004: written by run run-a, not by this run directory's run run-b "
                    "(run.json)"]
    assert resume_checkpoint(tmp_path, "run-c", log=said.append).name == "step_00000001"


def test_every_damaged_checkpoint_is_refused_naming_them_and_none_is_deleted(tmp_path):
    mgr = CheckpointManager(tmp_path, keep_last=5)
    for step in (2, 4):
        _flip(_checkpoint(mgr, step, "run-a"))
    with pytest.raises(RunDirError) as refused:
        resume_checkpoint(tmp_path, "run-a", log=lambda m: None)
    message = str(refused.value)
    assert "every checkpoint of this run is damaged: step_00000004 (engine/weights.bin: sha256 differs" in message
    assert "step_00000002 (" in message and "--resume never" in message and "Nothing was deleted" in message
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]


def test_a_new_save_over_a_damaged_checkpoint_moves_it_aside(tmp_path):
    said = []
    mgr = CheckpointManager(tmp_path, keep_last=5, run_id="run-a", log=said.append)
    damaged = _checkpoint(mgr, 4, "run-a")
    _flip(damaged)
    _checkpoint(mgr, 4, "run-a")
    [moved] = (tmp_path / "set_aside").glob("*/step_00000004")
    assert (moved / "engine" / "weights.bin").read_bytes()[3] == 3 ^ 1  # the damaged bytes, kept
    assert "moved to" in said[0] and "nothing was deleted" in said[0]


def test_retention_counts_only_this_runs_checkpoints(tmp_path):
    _checkpoint(CheckpointManager(tmp_path, keep_last=5), 1, "other-run")
    mgr = CheckpointManager(tmp_path, keep_last=1, run_id="run-a")
    for step in (2, 3):
        _checkpoint(mgr, step, "run-a")
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000003"]


@pytest.mark.parametrize("tag", ["../../elsewhere/global_step6", "/abs/global_step6", "a/b", "..", "", ".hidden"])
def test_latest_must_name_a_plain_tag(tmp_path, tag):
    (tmp_path / "latest").write_text(tag + "\n")
    with pytest.raises(UnsafeTag, match="not a plain checkpoint tag"):
        read_tag(tmp_path / "latest")


def test_a_zero_checkpoints_latest_is_not_followed_out_of_it(tmp_path):
    """A DeepSpeed folder whose ``latest`` names ``../other/global_step6``: the converter used to read
    the other folder's tensors as this checkpoint's."""
    from toolkit.formats.errors import ConvertError
    from toolkit.formats.zero_index import find_tag_dir
    (tmp_path / "other" / "global_step6").mkdir(parents=True)
    ckpt = tmp_path / "ckpt"
    (ckpt / "global_step2").mkdir(parents=True)
    (ckpt / "latest").write_text("../other/global_step6")
    with pytest.raises(ConvertError, match="not a plain checkpoint tag"):
        find_tag_dir(ckpt)
    (ckpt / "latest").write_text("global_step2\n")
    assert find_tag_dir(ckpt) == ckpt / "global_step2"


def test_a_full_disk_is_known_by_the_room_left_whatever_the_writer_said(tmp_path):
    """torch's zip writer on a full disk raises ``RuntimeError('... unexpected pos 576 vs 534')``
    without an errno (measured on a full tmpfs): the room left decides."""
    torch_words = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    assert looks_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path)
    assert not looks_full(torch_words, tmp_path, needed=1)  # this disk has room: another failure
    assert looks_full(torch_words, tmp_path, needed=1 << 62)  # less room than the write needs: full


def test_an_os_error_is_one_line_with_the_path_and_the_way_out():
    line = path_error(OSError(errno.EROFS, "Read-only file system", "/data/run"))
    assert line == "/data/run: read-only file system (EROFS); choose a path on a writable filesystem"
    assert path_error(OSError(errno.ECONNREFUSED, "Connection refused")) is None  # not about a path


def test_the_launchers_verification_is_not_repeated_by_the_first_attempt(tmp_path):
    """The launcher hashed the checkpoint it resumes; rank 0's first attempt checks its marker and
    sizes only (a 1 TB checkpoint is not read twice at start), any other is hashed as before."""
    mgr = CheckpointManager(tmp_path, keep_last=5)
    hashed_by_launcher = _checkpoint(mgr, 2, None)
    _flip(hashed_by_launcher)  # what only a second full read would see
    assert resume_checkpoint(tmp_path, None, verified=hashed_by_launcher) == hashed_by_launcher
    with pytest.raises(RunDirError, match="damaged"):
        resume_checkpoint(tmp_path, None, log=lambda m: None)

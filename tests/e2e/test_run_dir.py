"""Runs a user can trust with their run directory (issue 40), through the CLI on the tiny job:

- one writer per run directory: a second launch exits 2 within seconds naming the first, and the
  first trains exactly as it would alone;
- lineages never mix: ``--resume never`` sets the old run's checkpoints aside and a later ``--resume
  auto`` continues the new run, not the old one's newer step;
- the ranks' checks on the run directory come before launch and in ``--dry-run`` (another model's
  checkpoint, every checkpoint damaged, no room, no write access): exit 2, one message, no traceback,
  nothing written (a refusal met by the ranks themselves, on a restart, is not retried:
  ``tests/e2e/test_restart.py::test_kill_during_save_and_corrupt_checkpoint_is_refused_not_trained_over``);
- the disk says no: read-only folders in every command, and a real full disk recognized however
  torch's writer words it.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import threading
import time

import pytest

from tests.helpers.disks import read_only, small_disk
from tests.helpers.runs import REPO, losses, refused, resumes, run_cli, train, train_args
from toolkit.storage import verify_complete
from toolkit.watch.events import read_events

pytestmark = pytest.mark.slow

ZERO2 = ["checkpoint.every=3", "zero.stage=2"]  # the session's runs("zero2") job


@pytest.fixture(scope="module")
def alone(runs):
    return runs("zero2", "zero.stage=2")


def snapshot(run_dir) -> dict[str, bytes]:
    """Every file under the run directory with its bytes: a refusal must change none."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def copy_run(src, run_dir):
    """A run directory holding another run's checkpoints (as a user copies them; no run.json)."""
    shutil.copytree(src / "checkpoints", run_dir / "checkpoints")
    return run_dir


def flip_a_byte(ckpt) -> None:
    target = max((p for p in (ckpt / "engine").rglob("*.pt")), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 1
    target.write_bytes(bytes(data))


def test_a_second_launch_exits_2_at_once_and_the_first_trains_as_alone(tmp_path, data_cache, alone):
    """The second launch (another seed, as a user would mistype it) starts once the first's ranks are
    up; before the lock it rewrote plan.json under the first and trained beside it."""
    run_dir, second = tmp_path / "run", {}

    def launch_second():
        deadline = time.time() + 300
        while not (run_dir / "heartbeat").exists() and time.time() < deadline:  # the first's ranks run
            time.sleep(0.1)
        tic = time.perf_counter()
        second["proc"] = run_cli(train_args(run_dir, data_cache, *ZERO2, "train.seed=2"), check=False, timeout=300)
        second["seconds"] = time.perf_counter() - tic

    thread = threading.Thread(target=launch_second)
    thread.start()
    try:  # slow steps: the first is still training when the second arrives, on any machine
        train(run_dir, data_cache, *ZERO2, env={"TOOLKIT_FAULT": "slow:step=1:rank=0:ms=400"})
    finally:
        thread.join()
    proc = second["proc"]
    print(f"second launch refused after {second['seconds']:.1f} s (a new Python process: imports included)")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert f"is in use by another toolkit train: pid {os.getpid()} on {socket.gethostname()}" in proc.stderr
    assert "Traceback" not in proc.stderr and "--run-dir" in proc.stderr
    assert second["seconds"] < 60
    assert losses(run_dir) == losses(alone)
    assert json.loads((run_dir / "plan.json").read_text())["config"]["train"]["seed"] != 2  # the first's plan


def test_resume_never_sets_the_old_run_aside_and_auto_continues_the_new_one(tmp_path, data_cache):
    """Run A saves steps 2 and 4; run B (--resume never, another seed) saves step 2; --resume auto
    then continues B from its step 2. Before: A's step 4 stayed beside B's checkpoints and the resume
    took it, although ``latest`` named B's step 2."""
    run_dir = tmp_path / "run"
    train(run_dir, data_cache, "checkpoint.every=2", "train.steps=4")
    new = train(run_dir, data_cache, "checkpoint.every=2", "train.steps=2", "train.seed=2", "resume=never")
    train(run_dir, data_cache, "checkpoint.every=2", "train.steps=3", "train.seed=2")
    assert resumes(run_dir)[-1] == ("step_00000002", 2, "as saved")
    assert "--resume never: the previous run's checkpoints were moved to" in new.stdout
    [aside] = (run_dir / "set_aside").glob("*/checkpoints")
    assert sorted(p.name for p in aside.glob("step_*")) == ["step_00000002", "step_00000004"]
    assert len((aside.parent / "metrics.jsonl").read_text().splitlines()) > 4  # run A's curve went with them
    assert all(verify_complete(p) == [] for p in aside.glob("step_*"))  # set aside whole, never deleted
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    ours = [json.loads((p / "meta.json").read_text())["run_id"] for p in (run_dir / "checkpoints").glob("step_*")]
    theirs = json.loads((aside / "step_00000004" / "meta.json").read_text())["run_id"]
    assert ours == [run_id, run_id] and theirs != run_id


def another_model(tmp_path):
    config = json.loads((REPO / "toolkit" / "demo" / "tiny-llama" / "config.json").read_text())
    other = tmp_path / "other-model"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    return other


def test_another_models_checkpoint_is_refused_before_any_rank_starts(tmp_path, data_cache, alone):
    """Before: the dry run passed, config.yaml and plan.json were rewritten, the ranks refused under
    ~100 lines of elastic tracebacks (exit 1), and --max-restarts retried it."""
    run_dir, other = copy_run(alone, tmp_path / "run"), another_model(tmp_path)
    before = snapshot(run_dir)
    for dry_run in (["--dry-run"], []):
        code, out, err = refused(train_args(run_dir, data_cache, *ZERO2, f"model.name_or_path={other}",
                                            "restart.max_restarts=2") + dry_run)
        assert code == 2, err[-3000:]
        assert "holds another model (num_hidden_layers: checkpoint 4, this run 5)" in err and "--resume never" in err
        assert err.count("toolkit: error:") == 1 and "Traceback" not in err
        assert snapshot(run_dir) == before  # no config.yaml, plan.json, run.json, lock or event written


def test_every_damaged_checkpoint_is_refused_before_launch_and_kept(tmp_path, data_cache, alone):
    """Before: training started over from step 0 (exit 0) and its save of step 3 replaced the damaged one."""
    run_dir = copy_run(alone, tmp_path / "run")
    for ckpt in (run_dir / "checkpoints").glob("step_*"):
        flip_a_byte(ckpt)
    before = snapshot(run_dir)
    for dry_run in (["--dry-run"], []):
        code, out, err = refused(train_args(run_dir, data_cache, *ZERO2) + dry_run)
        assert code == 2, err[-3000:]
        assert "every checkpoint of this run is damaged: step_00000006 (" in err and "step_00000003 (" in err
        assert "--resume never" in err and "Nothing was deleted" in err and "Traceback" not in err
        assert snapshot(run_dir) == before


def test_read_only_places_are_one_message_with_the_path_in_every_command(tmp_path, data_cache, alone):
    """Before: tracebacks (convert, report --out, train), and a dry run that passed."""
    ro = tmp_path / "ro"
    with read_only(ro):
        for args in (train_args(ro / "run", data_cache, *ZERO2) + ["--dry-run"], train_args(ro / "run", data_cache),
                     ["convert", str(alone), str(ro / "out"), "--to", "hf"],
                     ["report", str(alone), "--out", str(ro / "report")]):
            code, out, err = refused(args)
            assert code == 2, (args, err[-3000:])
            assert str(ro) in err and ("EROFS" in err or "EACCES" in err) and "Traceback" not in err, err
    assert not any(ro.iterdir())


def test_a_read_that_fails_in_inspect_is_one_message_with_the_path(tmp_path, alone):
    """A read that fails on a file already open carries no path: the command names its own (before:
    an OSError traceback). The failing read is real: config.json links to /proc/self/mem (EIO at 0)."""
    src = tmp_path / "hf"
    shutil.copytree(alone / "hf_final", src)
    (src / "config.json").unlink()
    (src / "config.json").symlink_to("/proc/self/mem")
    code, out, err = refused(["inspect", str(src)])
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert f"toolkit: error: {src}: input/output error (EIO)" in err


def test_convert_onto_a_full_disk_names_it_however_torch_words_it(tmp_path, alone):
    """Before: torch's RuntimeError('... unexpected pos ...') as a traceback."""
    disk = tmp_path / "disk"
    with small_disk(disk, 2 << 20):  # the tiny model's 5 MB of fp32 weights do not fit
        code, out, err = refused(["convert", str(alone / "hf_final"), str(disk / "out"), "--to", "zero"])
        assert code == 2 and "Traceback" not in err, err[-3000:]
        assert f"the disk holding {disk} is full" in err and f"{disk / 'out'} was not written" in err
        assert not any(disk.iterdir())  # the staging folder is dropped: the room is back


def test_verify_of_a_model_type_transformers_lacks_is_one_message(tmp_path, alone):
    """The conversion is done, but --verify's logits need a transformers model: say so, with the
    tensors' result, exit 2 (before: a ValueError traceback listing every model type)."""
    src = tmp_path / "hf"
    shutil.copytree(alone / "hf_final", src)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "model_type": "weirdformer"}))
    code, out, err = refused(["convert", str(src), str(tmp_path / "out"), "--to", "zero", "--verify"])
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert f"{src}: --verify compares logits through transformers, which has no model_type 'weirdformer'" in err
    assert "tensors: 39 compared, 0 differ" in err


CHECKPOINT_BYTES = 20 << 20  # the tiny job's checkpoint: 1,262,720 parameters x 16 bytes (19.3 MiB)


def test_a_full_disk_is_recognized_however_torch_words_it(tmp_path, data_cache):
    """A disk with room for one checkpoint: step 2 is saved, step 4 fills it. torch's zip writer says
    ``unexpected pos``, with no errno; before, the event said ``disk_full: false`` and the hint was lost."""
    run_dir = tmp_path / "run"
    with small_disk(run_dir, CHECKPOINT_BYTES * 3 // 2):
        proc = train(run_dir, data_cache, "checkpoint.every=2", "train.steps=4", check=False)
        assert proc.returncode == 1
        [failed] = [e for e in read_events(run_dir) if e["kind"] == "checkpoint_failed"]
        print(json.dumps(failed["errors"], indent=1))
        assert (failed["step"], failed["kept"], failed["disk_full"]) == (4, "step_00000002", True)
        assert any("unexpected pos" in e or "ENOSPC" in e for e in failed["errors"].values())
        assert all(str(run_dir) in where for where in failed["full"].values())
        assert verify_complete(run_dir / "checkpoints" / "step_00000002") == []
        assert not list((run_dir / "checkpoints").glob(".staging-*"))  # its room given back


def test_a_run_dir_without_room_for_a_checkpoint_is_refused_before_launch(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    with small_disk(run_dir, CHECKPOINT_BYTES // 2):
        for dry_run in (["--dry-run"], []):
            code, out, err = refused(train_args(run_dir, data_cache) + dry_run)
            assert code == 2, err[-3000:]
            assert f"run dir {run_dir} has 10.0 MiB free, and this run writes 19.3 MiB at once" in err
        assert not any(run_dir.iterdir())

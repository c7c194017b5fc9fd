"""Fault tolerance end to end (DeepSpeed path): each fault kind, the job completes, and its losses
equal the uninterrupted run's bit for bit; events.jsonl records what happened."""
from __future__ import annotations

import json
import sys

import pytest

from tests.helpers.runs import REPO, losses, resumes, run_cli, train
from toolkit.storage import verify_complete

pytestmark = pytest.mark.slow

RESTART = ["restart.max_restarts=3", "restart.backoff_s=0.2", "checkpoint.every=2", "zero.stage=2"]


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def kinds(run_dir):
    return [e["kind"] for e in events(run_dir)]


@pytest.fixture(scope="module")
def uninterrupted(runs):
    return losses(runs("zero2", "zero.stage=2"))


def test_kill_exception_and_divergence_recover_exactly(tmp_path, data_cache, uninterrupted):
    run_dir = tmp_path / "run"
    faults = "kill:step=3:rank=1;diverge:step=4:rank=1;raise:step=5:rank=0;slow:step=1:rank=1:ms=600"
    train(run_dir, data_cache, *RESTART, "restart.divergence_every=1", "restart.straggler_every=2",
          env={"TOOLKIT_FAULT": faults})
    assert losses(run_dir) == uninterrupted
    # killed after step 3 and diverged at step 4 (both before step 4's save): step 2; raised at 5: step 4
    assert resumes(run_dir) == [("step_00000002", 2, "as saved"), ("step_00000002", 2, "as saved"),
                                ("step_00000004", 4, "as saved")]
    ev = events(run_dir)
    assert kinds(run_dir).count("restart") == 3 and "divergence" in kinds(run_dir)
    killed = [e for e in ev if e["kind"] == "failure" and e["signal"] == "SIGKILL"]
    assert killed and killed[0]["rank"] == 1 and killed[0]["step"] == 3
    divergence = next(e for e in ev if e["kind"] == "divergence")
    assert divergence["replica_groups"] == [[0], [1]]
    stragglers = [e for e in ev if e["kind"] == "straggler"]
    assert stragglers and {e["rank"] for e in stragglers} == {1}
    recovered = [e["time_to_recover_s"] for e in ev if e["kind"] == "recovered"]
    assert len(recovered) == 3 and all(t < 60 for t in recovered)


def test_hang_is_detected_named_and_restarted(tmp_path, data_cache, uninterrupted):
    run_dir = tmp_path / "run"
    train(run_dir, data_cache, *RESTART, "restart.hang_timeout_s=15", env={"TOOLKIT_FAULT": "hang:step=3:rank=1"})
    assert losses(run_dir) == uninterrupted
    assert resumes(run_dir) == [("step_00000002", 2, "as saved")]
    hang = next(e for e in events(run_dir) if e["kind"] == "hang")
    assert hang["stuck_ranks"] == [1] and hang["step"] == 3
    assert "faults.py" in (run_dir / "stacks" / "rank_00001.txt").read_text()


def test_sigterm_saves_and_exits_then_resumes(tmp_path, data_cache, uninterrupted):
    run_dir = tmp_path / "run"
    proc = train(run_dir, data_cache, *RESTART, env={"TOOLKIT_FAULT": "sigterm:step=3:rank=0"}, check=False)
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert (run_dir / "checkpoints" / "step_00000003" / "COMPLETE").exists()
    assert "preempt_saved" in kinds(run_dir) and "restart" not in kinds(run_dir)
    train(run_dir, data_cache, *RESTART)
    assert losses(run_dir) == uninterrupted
    assert resumes(run_dir) == [("step_00000003", 3, "as saved")]


def test_kill_during_save_and_corrupt_checkpoint_is_refused_not_trained_over(tmp_path, data_cache):
    """step 2 is committed then corrupted; step 4's save is killed half-way: the restart skips both (the
    half-written step 4 never became a checkpoint: only its staging directory exists; step 2 fails its
    checksum) and loads no poison. With no checkpoint of the run left whole, the restarted ranks refuse
    (before: they started over from step 0 and replaced the damaged step 2, exit 0); a refusal is not a
    fault: no second restart, exit 2, the ranks' message said once, step 2 kept as it is."""
    run_dir = tmp_path / "run"
    faults = "corrupt:step=2:rank=0;kill_in_save:step=4:rank=1"
    proc = train(run_dir, data_cache, *RESTART, env={"TOOLKIT_FAULT": faults}, check=False)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "every checkpoint of this run is damaged: step_00000002 (" in proc.stderr and "--resume never" in proc.stderr
    assert proc.stderr.count("toolkit: error:") == 1 and "exitcode: 78" not in proc.stderr  # no traceback for it
    assert resumes(run_dir) == []
    skipped = [e["reason"] for e in events(run_dir) if e["kind"] == "checkpoint_skipped"]
    assert len(skipped) == 1 and skipped[0].startswith("skipping checkpoint step_00000002: "), skipped
    assert "sha256 differs from the manifest (corrupted)" in skipped[0]
    assert kinds(run_dir).count("restart") == 1 and "refused" in kinds(run_dir) and "gave_up" not in kinds(run_dir)
    assert verify_complete(run_dir / "checkpoints" / "step_00000002") != []  # still there, still damaged


def test_exhausted_budget_fails_clearly_and_keeps_checkpoints(tmp_path, data_cache):
    run_dir = tmp_path / "run"
    proc = train(run_dir, data_cache, "restart.max_restarts=0", "checkpoint.every=1",
                 env={"TOOLKIT_FAULT": "kill:step=2:rank=0"}, check=False)
    assert proc.returncode == 1 and "job failed after 0 restart(s) allowed" in proc.stderr
    assert kinds(run_dir)[-1] == "gave_up"
    assert (run_dir / "checkpoints" / "step_00000001" / "COMPLETE").exists()  # killed before step 2's save


def test_resume_at_another_zero_stage_converts_and_continues(tmp_path, data_cache, runs):
    """A ZeRO-2 checkpoint resumed by a ZeRO-3 run: converted (toolkit convert, DeepSpeed's universal
    layout) and loaded; the losses go on as the ZeRO-3 run's own, optimizer state included."""
    run_dir = tmp_path / "run"
    train(run_dir, data_cache, "checkpoint.every=2", "zero.stage=2", "train.steps=2")
    train(run_dir, data_cache, "checkpoint.every=2", "zero.stage=3")
    assert losses(run_dir)[2:] == pytest.approx(losses(runs("zero3", "zero.stage=3"))[2:], rel=1e-6)
    assert resumes(run_dir) == [("step_00000002", 2, "converted")]
    assert not any((run_dir / "resharded").iterdir())  # the conversion is dropped once loaded


def test_supervise_restarts_any_script(tmp_path):
    run_dir = tmp_path / "sup"
    proc = run_cli(["supervise", "--nproc", "2", "--run-dir", str(run_dir), "--max-restarts", "1",
                    "--backoff-s", "0.1", "--", str(REPO / "tests" / "scripts" / "flaky_ddp.py")],
                   env={"PYTHONPATH": str(REPO)}, timeout=300)
    assert "rank 0 done, attempt 1" in proc.stdout
    ev = events(run_dir)
    assert [e["kind"] for e in ev].count("restart") == 1
    assert any(e["kind"] == "failure" and e["exit_code"] == 13 and e["rank"] == 1 for e in ev)


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT", "SIGHUP"])
def test_sigterm_to_the_launcher_saves_and_resumes(tmp_path, data_cache, uninterrupted, signal_name):
    """What a scheduler does on preemption: SIGTERM to `toolkit train` itself; a Ctrl-C (SIGINT) or a
    lost terminal (SIGHUP), which the launcher passes on to its ranks, stop it the same way."""
    import os
    import signal
    import subprocess
    import time

    from tests.helpers.runs import TINY
    run_dir = tmp_path / "run"
    sets = [a for s in [*TINY, f"data.cache_dir={data_cache}", *RESTART] for a in ("--set", s)]
    cmd = [sys.executable, "-m", "toolkit", "train", "--run-dir", str(run_dir), "--nproc", "2", *sets]
    env = {**os.environ, "TOOLKIT_FAULT": "slow:step=1:rank=0:ms=1500"}  # slow steps: time to signal
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and len(losses(run_dir) if (run_dir / "metrics.jsonl").exists() else []) < 2:
        time.sleep(0.2)
    proc.send_signal(getattr(signal, signal_name))
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]
    saved = [e["step"] for e in events(run_dir) if e["kind"] == "preempt_saved"]
    assert len(saved) == 1 and saved[0] >= 2
    train(run_dir, data_cache, *RESTART)
    assert losses(run_dir) == uninterrupted
    assert resumes(run_dir) == [(f"step_{saved[0]:08d}", saved[0], "as saved")]


def test_sigquit_to_the_launcher_says_nothing_was_saved_and_the_run_resumes(tmp_path, data_cache, uninterrupted):
    """SIGQUIT, which the launcher passes on too, ends the ranks where they are: the launcher must not
    claim a save (it did: exit 75, "ranks saved a checkpoint"); the same command resumes from the
    newest complete checkpoint and continues the loss curve."""
    import os
    import resource
    import signal
    import subprocess
    import time

    from tests.helpers.runs import TINY
    run_dir = tmp_path / "run"
    sets = [a for s in [*TINY, f"data.cache_dir={data_cache}", *RESTART] for a in ("--set", s)]
    cmd = [sys.executable, "-m", "toolkit", "train", "--run-dir", str(run_dir), "--nproc", "2", *sets]
    env = {**os.environ, "TOOLKIT_FAULT": "slow:step=1:rank=0:ms=1500"}
    def no_cores():  # SIGQUIT's default action dumps core; the ranks inherit the limit
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=no_cores)
    deadline = time.time() + 300
    while time.time() < deadline and not list((run_dir / "checkpoints").glob("step_*/COMPLETE")):
        time.sleep(0.2)
    proc.send_signal(signal.SIGQUIT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 1, out[-3000:]
    assert "without a save" in out and "ranks saved a checkpoint" not in out, out[-3000:]
    assert [e["kind"] for e in events(run_dir) if e["kind"] in ("preempt_saved", "stopped")] == ["stopped"]
    train(run_dir, data_cache, *RESTART)
    assert losses(run_dir) == uninterrupted
    assert len(resumes(run_dir)) == 1


def test_async_saves_match_and_survive_a_kill_mid_persist(tmp_path, data_cache, uninterrupted):
    """Asynchronous saves (node-local snapshot, background persist): the losses are the synchronous
    run's; rank 0 is killed while persisting step 4, so step 4 is never committed, the restart
    resumes from step 2, and every checkpoint left behind verifies."""
    from toolkit.storage import verify_complete
    run_dir, local = tmp_path / "run", tmp_path / "local"
    train(run_dir, data_cache, *RESTART, "checkpoint.async_save=true", f"checkpoint.local_dir={local}",
          env={"TOOLKIT_FAULT": "kill_in_persist:step=4:rank=0"})
    assert losses(run_dir) == uninterrupted
    killed = next(e for e in events(run_dir) if e["kind"] == "failure")
    assert killed["rank"] == 0 and killed["signal"] == "SIGKILL"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert resumes(run_dir) == [("step_00000002", 2, "as saved")]
    saves = [r for r in rows if r.get("event") == "checkpoint"]
    assert saves and all(r["async"] for r in saves)
    ckpts = run_dir / "checkpoints"
    assert (ckpts / "latest").read_text() == "step_00000006"
    assert all(verify_complete(c) == [] for c in ckpts.glob("step_*"))
    assert not list(local.glob("*/step_*"))  # snapshots are dropped once persisted

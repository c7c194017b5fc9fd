"""More fault kinds, each survived with nothing lost (DeepSpeed ZeRO-2, the tiny demo job): a crash
by ``os.abort`` and a Ctrl-C (SIGINT) in the middle of a step, an exception in the asynchronous
save's background writer, and a full disk (ENOSPC) while a checkpoint is written. Each run resumes
from the checkpoint asserted here, and its losses equal the uninterrupted run's bit for bit."""
from __future__ import annotations

import pytest

from tests.helpers.runs import losses, resumes, train
from toolkit.storage import verify_complete
from toolkit.watch.events import read_events

pytestmark = pytest.mark.slow

RESTART = ["restart.max_restarts=3", "restart.backoff_s=0.2", "checkpoint.every=2", "zero.stage=2"]


@pytest.fixture(scope="module")
def uninterrupted(runs):
    return losses(runs("zero2", "zero.stage=2"))


def kinds(run_dir):
    return [e["kind"] for e in read_events(run_dir)]


def all_verify(run_dir) -> bool:
    return all(verify_complete(c) == [] for c in (run_dir / "checkpoints").glob("step_*"))


def test_abort_mid_step_restarts_from_the_last_checkpoint(tmp_path, data_cache, uninterrupted):
    run_dir = tmp_path / "run"
    train(run_dir, data_cache, *RESTART, env={"TOOLKIT_FAULT": "abort:step=3:rank=1"})
    assert losses(run_dir) == uninterrupted
    assert resumes(run_dir) == [("step_00000002", 2, "as saved")]  # aborted inside step 3
    aborted = [e for e in read_events(run_dir) if e["kind"] == "failure" and e["signal"] == "SIGABRT"]
    assert [e["rank"] for e in aborted] == [1]


def test_sigint_mid_step_saves_and_exits_then_resumes(tmp_path, data_cache, uninterrupted):
    """Ctrl-C is preemption, as SIGTERM: the step in flight finishes, every rank saves it, the job
    exits 75 without a restart, and the same command resumes from that checkpoint."""
    run_dir = tmp_path / "run"
    proc = train(run_dir, data_cache, *RESTART, env={"TOOLKIT_FAULT": "sigint:step=3:rank=0"}, check=False)
    assert proc.returncode == 75, proc.stderr[-2000:]
    assert "preempt_saved" in kinds(run_dir) and "restart" not in kinds(run_dir)
    assert (run_dir / "checkpoints" / "step_00000003" / "COMPLETE").exists()
    train(run_dir, data_cache, *RESTART)
    assert losses(run_dir) == uninterrupted
    assert resumes(run_dir) == [("step_00000003", 3, "as saved")]


def checkpoint_failures(run_dir) -> list[dict]:
    return [e for e in read_events(run_dir) if e["kind"] == "checkpoint_failed"]


def test_exception_in_the_background_persist_is_reported_and_never_committed(tmp_path, data_cache,
                                                                               uninterrupted):
    run_dir, local = tmp_path / "run", tmp_path / "local"
    train(run_dir, data_cache, *RESTART, "checkpoint.async_save=true", f"checkpoint.local_dir={local}",
          env={"TOOLKIT_FAULT": "raise_in_persist:step=4:rank=0"})
    assert losses(run_dir) == uninterrupted
    assert resumes(run_dir) == [("step_00000002", 2, "as saved")]  # step 4 was never committed
    [failed] = checkpoint_failures(run_dir)
    assert (failed["step"], failed["kept"], failed["disk_full"]) == (4, "step_00000002", False)
    assert "background persist failed" in failed["errors"]["0"] and "injected fault" in failed["errors"]["0"]
    assert all_verify(run_dir) and (run_dir / "checkpoints" / "latest").read_text() == "step_00000006"


def test_full_disk_while_writing_a_checkpoint_keeps_the_last_good_one(tmp_path, data_cache, uninterrupted):
    """Rank 1 gets ENOSPC writing step 4: every rank learns it at once (no rank left in a barrier),
    the half-written step 4 is dropped, the event names the full disk and the checkpoint kept, and
    the restart resumes from step 2."""
    run_dir = tmp_path / "run"
    train(run_dir, data_cache, *RESTART, env={"TOOLKIT_FAULT": "enospc:step=4:rank=1"})
    assert losses(run_dir) == uninterrupted
    assert resumes(run_dir) == [("step_00000002", 2, "as saved")]
    [failed] = checkpoint_failures(run_dir)
    assert (failed["step"], failed["kept"], failed["disk_full"]) == (4, "step_00000002", True)
    assert list(failed["errors"]) == ["1"] and failed["errors"]["1"].startswith("ENOSPC: ")
    assert all_verify(run_dir) and not list((run_dir / "checkpoints").glob(".staging-*"))

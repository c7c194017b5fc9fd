"""Fault tolerance end to end on the Megatron path (TP=2 x DP=2 on 4 ranks, distributed optimizer):
every fault kind once, the job completes with the uninterrupted run's losses bit for bit, and
events.jsonl records what happened. The DeepSpeed path has the same matrix in test_restart.py."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.runs import losses, resumes, train

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

MEGATRON = ["backend=megatron", "megatron.tp=2", "checkpoint.every=2", "restart.backoff_s=0.2"]
NPROC = 4  # tp=2 x dp=2: a replica group of two, so divergence between replicas can be detected


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, data_cache):
    run_dir = tmp_path_factory.mktemp("mcore_faults") / "uninterrupted"
    train(run_dir, data_cache, *MEGATRON, nproc=NPROC)
    return losses(run_dir)


def test_crash_corruption_and_divergence_recover_exactly(tmp_path, data_cache, uninterrupted):
    """One job through five faults: a committed checkpoint corrupted (the restart falls back to the
    one before it), a rank SIGKILLed, a save killed half-way, a replica perturbed (caught by the
    checksum), an exception."""
    run_dir = tmp_path / "run"
    faults = ("corrupt:step=2:rank=0;kill:step=3:rank=1;kill_in_save:step=4:rank=3;"
              "diverge:step=5:rank=3;raise:step=6:rank=0")
    train(run_dir, data_cache, *MEGATRON, "checkpoint.every=1", "restart.max_restarts=5",
          "restart.divergence_every=1", nproc=NPROC, env={"TOOLKIT_FAULT": faults})
    assert losses(run_dir) == uninterrupted
    # kill at 3: step 2 corrupted, back to step 1 (its save over the damaged step 2 sets that aside);
    # save of 4 killed: step 3; diverge at 5: step 4; raise at 6: step 5
    assert resumes(run_dir) == [("step_00000001", 1, "as saved"), ("step_00000003", 3, "as saved"),
                                ("step_00000004", 4, "as saved"), ("step_00000005", 5, "as saved")]
    assert [p.name for p in run_dir.glob("set_aside/*/step_*")] == ["step_00000002"]  # kept, never deleted
    ev = events(run_dir)
    kinds = [e["kind"] for e in ev]
    assert kinds.count("restart") == 4, kinds
    assert any(e["kind"] == "failure" and e["signal"] == "SIGKILL" and e["rank"] == 1 for e in ev)
    skipped = [e["reason"] for e in ev if e["kind"] == "checkpoint_skipped"]
    assert len(skipped) == 1 and skipped[0].startswith("skipping checkpoint step_00000002: "), skipped
    assert "(corrupted)" in skipped[0]
    divergence = next(e for e in ev if e["kind"] == "divergence")
    assert sorted(divergence["replica_groups"]) == [[1], [3]], divergence  # the tp-rank-1 replicas
    assert not any((run_dir / "checkpoints").glob(".staging-*"))


def test_hang_then_preemption_then_resume(tmp_path, data_cache, uninterrupted):
    """A hung rank is named and the job restarted; later SIGTERM saves and exits 75; the same
    command resumes and finishes with the uninterrupted losses. Saves are asynchronous here: the
    preemption waits for its checkpoint to be committed before exiting."""
    run_dir = tmp_path / "run"
    faults = "hang:step=2:rank=3;sigterm:step=4:rank=0"
    asynchronous = ("checkpoint.async_save=true", f"checkpoint.local_dir={tmp_path / 'local'}")
    proc = train(run_dir, data_cache, *MEGATRON, *asynchronous, "restart.max_restarts=2", "restart.hang_timeout_s=15",
                 nproc=NPROC, env={"TOOLKIT_FAULT": faults}, check=False)
    assert proc.returncode == 75, proc.stderr[-3000:]
    hang = next(e for e in events(run_dir) if e["kind"] == "hang")
    assert hang["stuck_ranks"] == [3] and hang["step"] == 2
    assert (run_dir / "checkpoints" / "step_00000004" / "COMPLETE").exists()
    train(run_dir, data_cache, *MEGATRON, *asynchronous, "restart.max_restarts=2", nproc=NPROC)
    assert losses(run_dir) == uninterrupted
    # the hang at step 2 came before step 2's save: the restart started over; then the preemption's
    assert resumes(run_dir) == [("step_00000004", 4, "as saved")]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["async"] for r in rows if r.get("event") == "checkpoint")


def test_abort_sigint_and_full_disk_recover_exactly(tmp_path, data_cache, uninterrupted):
    """The newer fault kinds on 4 ranks: os.abort inside step 3 (restart from step 2), ENOSPC on rank
    2 while writing step 4 (every rank fails at once, step 4 is dropped, restart from step 2), and
    a Ctrl-C inside step 5 (save step 5, exit 75); the same command resumes from step 5."""
    run_dir = tmp_path / "run"
    faults = "abort:step=3:rank=1;enospc:step=4:rank=2;sigint:step=5:rank=3"
    proc = train(run_dir, data_cache, *MEGATRON, "restart.max_restarts=3", nproc=NPROC,
                 env={"TOOLKIT_FAULT": faults}, check=False)
    assert proc.returncode == 75, proc.stderr[-3000:]
    ev = events(run_dir)
    assert [e["rank"] for e in ev if e["kind"] == "failure" and e["signal"] == "SIGABRT"] == [1]
    [failed] = [e for e in ev if e["kind"] == "checkpoint_failed"]
    assert (failed["step"], failed["kept"], failed["disk_full"], list(failed["errors"])) == (4, "step_00000002",
                                                                                            True, ["2"])
    assert (run_dir / "checkpoints" / "step_00000005" / "COMPLETE").exists()
    train(run_dir, data_cache, *MEGATRON, nproc=NPROC)
    assert losses(run_dir) == uninterrupted
    assert resumes(run_dir) == [("step_00000002", 2, "as saved"), ("step_00000002", 2, "as saved"),
                                ("step_00000005", 5, "as saved")]

"""The hang watchdog judges each heartbeat phase by its own budget (``toolkit/watch/budgets.py``):
long healthy work (an eval, a save, the final export), which beats as it progresses, is not a hang;
a rank stuck in a load or a save is caught, its phase named in events.jsonl and its stacks, and the
job recovers from the last good checkpoint with the uninterrupted run's losses."""
from __future__ import annotations

import json
import shutil

import pytest

from tests.helpers.runs import TINY, losses, resumes, train
from toolkit.config import RestartConfig
from toolkit.launch.agent import find_hang
from toolkit.watch.budgets import collective_timeout_s, phase_budgets
from toolkit.watch.heartbeat import Heartbeat, read_heartbeats

# --- the rule and the judgement (no processes) ----------------------------------------------------


def test_budgets_scale_with_the_model_bytes_and_can_be_set():
    restart = RestartConfig(hang_timeout_s=60, io_bytes_per_s=1e9, startup_s=120)
    b = phase_budgets(restart, trained_params=7_000_000_000, total_params=7_000_000_000)
    assert b["step"] == b["ready"] == b["eval"] == 60
    assert b["save"] == 60 + 7e9 * 16 / 1e9  # 112 GB of weights, fp32 masters and Adam moments
    assert b["export"] == 60 + 7e9 * 4 / 1e9  # fp32 hf_final
    assert b["load"] == 120 + 7e9 * (4 + 16) / 1e9
    assert b["reshard"] == 60 + 2 * 7e9 * 16 / 1e9
    lora = phase_budgets(restart, trained_params=10_000_000, total_params=7_000_000_000)
    assert lora["save"] == pytest.approx(60.16) and lora["export"] == b["export"]  # adapters saved, all exported
    explicit = phase_budgets(RestartConfig(hang_timeout_s=60, save_timeout_s=5, eval_timeout_s=7), 1000, 1000)
    assert explicit["save"] == 5 and explicit["eval"] == 7
    assert phase_budgets(RestartConfig(hang_timeout_s=0), 1000, 1000) == {}  # the watchdog is off
    big = phase_budgets(RestartConfig(), 70_000_000_000, 70_000_000_000)  # the defaults, a 70B model
    assert max(big.values()) > 600 and collective_timeout_s(big) > max(big.values())  # the watchdog judges first
    assert collective_timeout_s(phase_budgets(RestartConfig(hang_timeout_s=2), 10, 10)) == 600


def beat(rank, phase, time, budget, step=3):
    return {"rank": rank, "step": step, "phase": phase, "time": time, "budget_s": budget}


def test_each_phase_is_judged_by_its_own_budget():
    now = 1000.0
    saving = {0: beat(0, "save", now - 50, budget=60), 1: beat(1, "save", now - 50, budget=60)}
    assert find_hang(saving, [0, 1], now, 0, default_budget_s=10, load_timeout_s=None) is None
    stuck = {0: beat(0, "save", now - 61, budget=60), 1: beat(1, "save", now - 70, budget=60)}
    assert find_hang(stuck, [0, 1], now, 0, 10, None) == stuck
    # rank 1 waits for rank 0, who exports alone and beats per tensor: silent, not stuck
    alone = {0: beat(0, "export", now - 1, budget=60), 1: beat(1, "export", now - 500, budget=60)}
    assert find_hang(alone, [0, 1], now, 0, 10, None) is None
    # a beat without a budget (a plain script under `toolkit supervise`): hang_timeout_s
    plain = {0: {"rank": 0, "step": 3, "phase": "step", "time": now - 11}}
    assert find_hang(plain, [0], now, 0, 10, None)[0]["budget_s"] == 10


def test_ranks_are_watched_from_their_start_when_they_beat_while_loading():
    now, started = 1000.0, 900.0
    hang = find_hang({}, [0, 1], now, started, default_budget_s=10, load_timeout_s=60)
    assert hang is not None and {b["phase"] for b in hang.values()} == {"load"}
    assert find_hang({}, [0, 1], now, started, 10, load_timeout_s=120) is None  # still within the load budget
    assert find_hang({}, [0, 1], now, started, 10, load_timeout_s=None) is None  # supervise: once it beats


def test_a_beat_states_its_phase_and_budget_and_progress_beats_again(tmp_path):
    hb = Heartbeat(tmp_path, 3, budgets={"save": 42.0})
    hb.beat(7, "save")
    first = read_heartbeats(tmp_path)[3]
    assert (first["phase"], first["step"], first["budget_s"]) == ("save", 7, 42.0)
    hb._last -= 1  # progress beats are spaced (PROGRESS_EVERY_S): pretend a second went by
    hb.progress()
    again = read_heartbeats(tmp_path)[3]
    assert again["phase"] == "save" and again["time"] > first["time"]
    with pytest.raises(ValueError, match="phase 'saving' is not one of"):
        hb.beat(7, "saving")


# --- launched runs ----------------------------------------------------------------------------------

HANG_TIMEOUT_S = 4
BACKENDS = {"deepspeed": ["zero.stage=2"], "megatron": ["backend=megatron", "megatron.tp=2"]}
PHASES = ["restart.max_restarts=3", "restart.backoff_s=0.2", "checkpoint.every=2",
          f"restart.hang_timeout_s={HANG_TIMEOUT_S}"]


def events(run_dir):
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def uninterrupted_runs(runs):
    """The run without faults, per backend (its checkpoints: steps 3 and 6); DeepSpeed's is shared with
    other modules' tests."""
    names = {"deepspeed": ("zero2", "zero.stage=2"), "megatron": ("megatron_tp2", *BACKENDS["megatron"])}
    return lambda backend: runs(*names[backend])


@pytest.fixture(scope="module")
def uninterrupted(uninterrupted_runs):
    return losses(uninterrupted_runs("deepspeed"))


@pytest.mark.slow
def test_long_eval_save_and_export_are_not_hangs(tmp_path, data_cache, uninterrupted):
    """Each longer than hang_timeout_s, beating as they go: an eval of 4 micro-batches x 1.5 s, a save
    of 2-3 files x 2.5 s per rank, an export of 39 tensors x 0.15 s. Before phases, a beat came only
    at step boundaries and the watchdog killed the eval, restarted the job and killed it again."""
    run_dir = tmp_path / "run"
    slow = ";".join(f"slow_eval:step=3:ms=1500:rank={r};slow_save:step=4:ms=2500:rank={r};"
                    f"slow_export:step=6:ms=150:rank={r}" for r in (0, 1))
    train(run_dir, data_cache, *PHASES, *BACKENDS["deepspeed"], "train.eval_every=3", "train.export_hf=true",
          "restart.load_timeout_s=120", env={"TOOLKIT_FAULT": slow})
    kinds = [e["kind"] for e in events(run_dir)] if (run_dir / "events.jsonl").exists() else []
    assert "hang" not in kinds and "restart" not in kinds, kinds
    assert losses(run_dir) == uninterrupted and resumes(run_dir) == []
    metrics = rows(run_dir)
    evals = {r["step"]: r["eval_s"] for r in metrics if "eval_loss" in r}
    assert evals[3] > HANG_TIMEOUT_S, evals
    saves = {r["step"]: r["checkpoint_blocked_s"] for r in metrics if r.get("event") == "checkpoint"}
    assert saves[4] > 1.5 * HANG_TIMEOUT_S, saves  # longer than the save budget (4.2 s) too
    assert (run_dir / "hf_final" / "config.json").exists()
    _exported_beating(run_dir)


def _exported_beating(run_dir) -> None:
    """The export beat through its slow tensors: rank 0 (it exports alone) beat in phase export longer than
    the hang timeout after the metrics' last line (the loop's end)."""
    last = read_heartbeats(run_dir)[0]
    assert last["phase"] == "export" and last["time"] - (run_dir / "metrics.jsonl").stat().st_mtime > HANG_TIMEOUT_S


@pytest.mark.slow
def test_hangs_in_a_save_and_a_load_are_caught_by_phase_and_recovered(tmp_path, data_cache, uninterrupted):
    """Rank 1 stops inside step 4's save (after its engine files, no more progress): caught after the
    save budget, named "save"; the restart resumes step 2, where rank 0 stops inside the load: caught
    after the load budget, named "load"; the next restart resumes step 2 again and finishes."""
    run_dir = tmp_path / "run"
    train(run_dir, data_cache, *PHASES, *BACKENDS["deepspeed"], "restart.load_timeout_s=30",
          env={"TOOLKIT_FAULT": "hang_in_save:step=4:rank=1;hang_in_load:step=2:rank=0"})
    assert losses(run_dir) == uninterrupted
    _save_then_load_hangs(run_dir)


def _save_then_load_hangs(run_dir) -> None:
    """A hang in step 4's save on rank 1, then in step 2's load on rank 0: named, timed and recovered."""
    assert resumes(run_dir) == [("step_00000002", 2, "as saved")]  # the load that hung never finished
    hangs = [e for e in events(run_dir) if e["kind"] == "hang"]
    assert [(h["phase"], h["stuck_ranks"]) for h in hangs] == [("save", [1]), ("load", [0])], hangs
    assert hangs[0]["step"] == 4 and hangs[1]["step"] == 2
    for recovered in [e for e in events(run_dir) if e["kind"] == "recovered"]:  # where each recovery's time went
        b = recovered["breakdown_s"]
        assert 0 <= b["backoff"] <= b["torn_down"] <= b["rendezvous"] <= b["ranks_started"], b
        assert b["rendezvous"] <= b["rank_up"] <= b["checkpoint_loaded"] <= b["first_step_done"], b
        assert b["first_step_done"] >= recovered["time_to_recover_s"] - 0.1, (b, recovered)  # detected before the event
    stacks = {r: (run_dir / "stacks" / f"rank_{r:05d}.txt").read_text() for r in (0, 1)}
    assert "rank 1 silent in phase 'save' (step 4" in stacks[1] and "in_save" in stacks[1]
    assert "rank 0 silent in phase 'load' (step 2" in stacks[0] and "in_load" in stacks[0]


@pytest.mark.slow
def test_megatron_beats_every_phase(tmp_path, data_cache, uninterrupted_runs):
    """The same on megatron TP 2, in one run: an eval of 4 micro-batches x 1.5 s (beaten as the schedule
    takes each) is not a hang; rank 1 stops inside step 4's save (megatron's dist_checkpointing writes its
    files in one call, then the rank's RNG file: "save"), the restart's load of step 2 stops on rank 0
    ("load"), the next restart finishes on the uninterrupted losses, and its export of 0.15 s per tensor
    beats through."""
    run_dir = tmp_path / "run"
    faults = ";".join(f"slow_eval:step=3:ms=1500:rank={r};slow_export:step=6:ms=150:rank={r}" for r in (0, 1))
    train(run_dir, data_cache, *PHASES, *BACKENDS["megatron"], "train.eval_every=3", "train.export_hf=true",
          "restart.load_timeout_s=30",
          env={"TOOLKIT_FAULT": f"{faults};hang_in_save:step=4:rank=1;hang_in_load:step=2:rank=0"})
    assert losses(run_dir) == losses(uninterrupted_runs("megatron"))
    _save_then_load_hangs(run_dir)
    evals = [r["eval_s"] for r in rows(run_dir) if "eval_loss" in r and r["step"] == 3]
    assert len(evals) == 2 and min(evals) > HANG_TIMEOUT_S, evals  # before the save hang, and after the restarts
    _exported_beating(run_dir)


class _Notes:
    """The metrics logger's part a Checkpointer uses, kept."""

    def __init__(self):
        self.lines, self.records = [], []

    def note(self, line: str) -> None:
        self.lines.append(line)

    def log(self, record: dict) -> None:
        self.records.append(record)


def _resume_phases(rank, world, run_dir, overrides):
    """Resume ``run_dir``'s newest checkpoint into a new engine at this job's layout, recording the heartbeat
    phases the Checkpointer beats (``Trainer._phase`` in a run) and the resume it logs."""
    from pathlib import Path

    from toolkit.checkpoint.checkpointer import Checkpointer
    from toolkit.config import load_config
    from toolkit.plan import build_plan
    from toolkit.train.worker import build_engine
    from toolkit.watch.faults import FaultInjector
    run_dir = Path(run_dir)
    plan = build_plan(load_config(None, [*TINY, f"run_dir={run_dir}", *overrides]), [world])
    engine = build_engine(plan, run_dir, rank)
    phases, notes = [], _Notes()

    def phase(name, step=None):
        phases.append((name, step))
        return lambda: None
    Checkpointer(plan, engine, run_dir, rank, notes, FaultInjector(run_dir, rank, spec=""), phase=phase).resume()
    if plan.config.backend == "megatron":
        from tests.helpers.ranks import release_megatron
        release_megatron()
    return {"phases": phases, "resume": [r for r in notes.records if r.get("event") == "resume"]}


@pytest.mark.slow
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_a_resume_at_another_layout_beats_reshard_then_load(backend, tmp_path, uninterrupted_runs):
    """A checkpoint of 2 ranks (ZeRO-2 DP 2; megatron TP 2) resumed on one: the conversion (DeepSpeed's
    universal layout; megatron's resharding load) is judged by the reshard budget, what follows by load's."""
    from tests.helpers.ranks import run_ranks
    shutil.copytree(uninterrupted_runs(backend) / "checkpoints", tmp_path / "run" / "checkpoints")
    overrides = ["zero.stage=2"] if backend == "deepspeed" else ["backend=megatron"]
    got = run_ranks(_resume_phases, 1, tmp_path, str(tmp_path / "run"), overrides)[0]
    assert got["phases"] == [("reshard", 6), ("load", 6)], got
    assert [(r["step"], r["loaded"] != "as saved") for r in got["resume"]] == [(6, True)], got


@pytest.mark.slow
def test_a_hang_in_the_step_after_a_save_or_an_eval_is_judged_by_the_step_budget(tmp_path, data_cache, uninterrupted):
    """The save of step 2 and the eval of step 3 beat their phases, whose budgets (60 s) are far above
    the hang timeout; the step after each beats ``step`` from its start. Rank 1 stops inside step 3 (after
    the save): caught within the step budget and named "step"; the restart resumes step 2 and evaluates
    at step 3, then rank 0 stops inside step 4: "step" again. Before the step beat its own phase, the
    first hang waited out the save budget and was named "save", the second "eval"."""
    run_dir = tmp_path / "run"
    train(run_dir, data_cache, *PHASES, *BACKENDS["deepspeed"], "train.eval_every=3", "restart.save_timeout_s=60",
          "restart.eval_timeout_s=60", "restart.load_timeout_s=120",
          env={"TOOLKIT_FAULT": "hang_in_step:step=3:rank=1;hang_in_step:step=4:rank=0"})
    hangs = [e for e in events(run_dir) if e["kind"] == "hang"]
    assert [(h["phase"], h["stuck_ranks"], h["step"]) for h in hangs] == [("step", [1], 2), ("step", [0], 3)], hangs
    for h in hangs:
        assert set(h["budgets_s"].values()) == {HANG_TIMEOUT_S}, h
        assert h["seconds_without_progress"] < 30, h  # judged by the step's 4 s, not the save's or eval's 60 s
    assert losses(run_dir) == uninterrupted
    assert resumes(run_dir) == [("step_00000002", 2, "as saved")] * 2
    assert [r["step"] for r in rows(run_dir) if "eval_loss" in r] == [3, 3, 6]  # the eval before the second hang

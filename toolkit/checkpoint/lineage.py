"""Which checkpoint a run resumes, and what a launch does to its run directory first. Decided the same
way before launch (``toolkit train`` and its ``--dry-run``: ``toolkit/run.py``) and in the
ranks at every restart (``Checkpointer.resume``), so that a run directory the ranks would refuse is
refused before any rank starts, with nothing written.

- ``--resume auto`` continues the run directory's lineage (``RUN_DIR/run.json``; ``storage/rundir.py``):
  the newest checkpoint of that run that verifies. Checkpoints of another run are skipped and named;
  when every checkpoint of the run is damaged the launch is refused (never restarted from step 0 over
  them, never deleted).
- ``--resume never`` starts a new lineage: the old run's checkpoints are moved aside (to
  ``RUN_DIR/set_aside/<UTC time>/checkpoints``, its metrics.jsonl and events.jsonl beside them), so
  no later resume can pick one of them up and the run's curves are its own.
- The checkpoint to resume must hold this run's model (every shape field of its config) and, for a
  LoRA run, the same adapters on the same base; its ``engine/latest`` must name a plain tag.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.checkpoint.reshard import check_same_lora, check_same_model
from toolkit.plan import Plan
from toolkit.storage import LATEST, UnsafeTag, read_tag, verify_complete
from toolkit.storage import meta as meta_files
from toolkit.storage.rundir import (
    CHECKPOINTS,
    RunDirError,
    lineage_of,
    new_run_id,
    newest_of_lineage,
    other_lineage,
    read_run_id,
    set_aside,
    step_dirs,
    write_run_id,
)

RUN_RECORDS = ("metrics.jsonl", "events.jsonl")
"""What a run appends to in its run directory besides checkpoints: set aside with them on --resume never."""


@dataclass(frozen=True)
class RunDirPlan:
    """What a launch will do with its run directory (read-only until ``prepare_run_dir``)."""
    run_dir: Path
    run_id: str
    resume: str
    record: bool  # run.json to (re)write: a new lineage, or an old run directory without one
    resume_from: Path | None = None
    set_aside: Path | None = None  # --resume never: the old lineage's checkpoints, moved aside first
    skipped: list[str] = field(default_factory=list)

    def lines(self, dry_run: bool = False) -> list[str]:
        """What the launch does with the run directory, in the words the launcher and the dry run say."""
        out = list(self.skipped)
        if self.set_aside is not None and dry_run:  # a launch says where they went (prepare_run_dir)
            old = step_dirs(self.run_dir)
            out.append(f"--resume never: would set aside {len(old)} checkpoint(s) of the previous run ({old[0].name} "
                       f"the newest) to {self.run_dir}/set_aside/<UTC time>/{CHECKPOINTS}; nothing is deleted")
        if self.resume_from is not None:
            out.append(f"resumes {self.resume_from.name} (step {_step(self.resume_from)}) of run {self.run_id}")
        else:
            out.append(f"starts run {self.run_id} from step 0" + (" (a new lineage)" if self.resume == "never" else ""))
        return out


def plan_run_dir(plan: Plan, resume: str | None = None) -> RunDirPlan:
    """The launch's decisions about ``plan.config.run_dir``, checked as the ranks would check them.
    Raises ``RunDirError`` naming the problem and the ways out; reads only."""
    run_dir, resume = Path(plan.config.run_dir), resume or plan.config.resume
    if resume == "never":
        old = step_dirs(run_dir)
        return RunDirPlan(run_dir, new_run_id(), resume, True, set_aside=(run_dir / CHECKPOINTS) if old else None)
    run_id = lineage_of(run_dir)
    skipped: list[str] = []
    ckpt = resume_checkpoint(run_dir, run_id, log=skipped.append)
    if ckpt is not None:
        check_resumable(ckpt, plan)
    return RunDirPlan(run_dir, run_id or new_run_id(), resume, read_run_id(run_dir) != run_id or run_id is None,
                      resume_from=ckpt, skipped=skipped)


def prepare_run_dir(state: RunDirPlan) -> list[str]:
    """Carry out a launch's decisions (the only writes): set the old lineage aside, record the run
    id. Returns what was done, to say."""
    said = []
    if state.set_aside is not None and state.set_aside.exists():
        stamp = time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
        moved = set_aside(state.run_dir, state.set_aside, stamp)
        for record in RUN_RECORDS:  # the curves of those checkpoints go with them: the report shows one run
            if (state.run_dir / record).exists():
                set_aside(state.run_dir, state.run_dir / record, stamp)
        said.append(f"--resume never: the previous run's checkpoints were moved to {moved}, with its "
                    f"{' and '.join(RUN_RECORDS)} (nothing was deleted)")
    if state.record:
        write_run_id(state.run_dir, state.run_id)
    return said


def run_id_for(run_dir: Path) -> str:
    """This run directory's run id, recorded first when it has none (a run started without the
    launcher, through the Python API): rank 0 only."""
    run_id = read_run_id(run_dir)
    if run_id is None:
        run_id = lineage_of(run_dir) or new_run_id()
        Path(run_dir).mkdir(parents=True, exist_ok=True)
        write_run_id(run_dir, run_id)
    return run_id


def resume_checkpoint(run_dir: Path, run_id: str | None, log=print, verified: Path | None = None) -> Path | None:
    """The newest checkpoint of ``run_id``'s lineage that verifies, or None when the run has none.
    Raises ``RunDirError`` when checkpoints are there and none may be resumed: a restart from step 0
    would write over them. ``verified``: a checkpoint the launcher verified (``VERIFIED_ENV``)."""
    found = newest_of_lineage(run_dir, run_id, log=log, verified=verified)
    candidates = step_dirs(run_dir)
    if found is not None or not candidates:
        return found
    reasons = [f"{c.name} ({other_lineage(c, run_id) or '; '.join(verify_complete(c)[:2])})" for c in candidates]
    ours = [c for c in candidates if other_lineage(c, run_id) is None]
    what = ("every checkpoint of this run is damaged" if ours else
            f"it holds only checkpoints of other runs, none of this run directory's run {run_id}")
    raise RunDirError(f"{run_dir}/{CHECKPOINTS}: {what}: {', '.join(reasons)}. Nothing was deleted. Start over "
                      f"here with --resume never (they are moved to {run_dir}/set_aside/), restore an intact copy, "
                      "or use another --run-dir")


def check_resumable(ckpt: Path, plan: Plan) -> None:
    """The checks a resume makes before loading ``ckpt``: this run's model, its LoRA adapters and
    base, and an ``engine/latest`` that stays inside the checkpoint. Raises ``RunDirError``."""
    check_same_model(ckpt, plan.model.hf)
    saved = meta_files.read_meta(ckpt)
    ours = lora_record(plan)
    check_same_lora(ckpt, saved, ours.get("lora"), ours.get("base_model"))
    pointer = ckpt / "engine" / LATEST
    if pointer.is_file():
        try:
            read_tag(pointer)
        except UnsafeTag as exc:
            raise RunDirError(f"checkpoint {ckpt} cannot be resumed: {exc}") from None


def lora_record(plan: Plan) -> dict:
    """meta.json's LoRA fields ({} for full fine-tuning): the adapters' spec and the base they need."""
    if plan.lora is None:
        return {}
    from toolkit.lora.quant import record
    m = plan.config.model
    base = meta_files.base_model_record(m.name_or_path, m.init, plan.config.train.seed)
    if record(plan.config) is not None:  # a 4-bit base (model.quantize): how it was quantized
        base["quantization"] = record(plan.config)
    return {"lora": plan.lora.model_dump(mode="json"), "base_model": base}


def _step(ckpt: Path) -> int:
    return int(ckpt.name.split("_")[-1])

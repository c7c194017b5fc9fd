"""How the training loop saves and resumes: synchronous or asynchronous saves of the engine's state,
every rank's RNG and the checkpoint's descriptions (``toolkit/storage/meta.py``), and a resume from
the newest complete checkpoint, resharded or converted when it was written at another layout.

The loop calls ``save(step, progress)``, ``poll()`` at step boundaries and ``resume()`` once; the
fault hooks (``watch/faults.py``) are called at the named points ``in_save``, ``in_persist`` and
``after_commit``.
"""
from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from toolkit import device
from toolkit.checkpoint.async_save import AsyncCheckpointer, local_root
from toolkit.checkpoint.lineage import check_resumable, lora_record, resume_checkpoint, run_id_for
from toolkit.checkpoint.manager import CheckpointError, CheckpointManager, SaveFailed
from toolkit.checkpoint.reshard import drop_conversion, engine_state_dir
from toolkit.estimate.goodput import CHECKPOINT_BYTES_PER_PARAM
from toolkit.parallel import rng_state, seed_everything, set_rng_state
from toolkit.plan import Plan
from toolkit.storage import meta
from toolkit.storage.rundir import VERIFIED_ENV, RunDirError
from toolkit.storage.space import describe_error, free_bytes, human_bytes, looks_full


class Checkpointer:
    def __init__(self, plan: Plan, engine, run_dir: Path, rank: int, metrics, hooks, phase=None):
        """``phase(name, step=None)``: beats the heartbeat phase ``name`` (at ``step``, default the
        loop's) and returns the callable that beats again after each unit of its work
        (``Trainer._phase``); None: no heartbeat."""
        self.plan, self.engine, self.run_dir, self.rank = plan, engine, Path(run_dir), rank
        self.metrics, self.hooks = metrics, hooks
        self.phase = phase or (lambda name, step=None: lambda: None)
        self.lora_meta = lora_record(plan)
        self.run_id = run_id_for(self.run_dir) if rank == 0 else None  # rank 0 finds, writes and describes
        c = plan.config.checkpoint
        self.manager = CheckpointManager(self.run_dir, c.keep_last, self.run_id, log=metrics.note)
        self.async_ckpt = None
        if c.async_save:
            self.async_ckpt = AsyncCheckpointer(
                self.manager, local_root(c.local_dir, self.run_dir), int(os.environ.get("LOCAL_RANK", "0")),
                log=metrics.note, on_file=lambda rel: hooks.in_persist(self.async_ckpt.pending))
            self.async_ckpt.clear_stale()

    def due(self, step: int) -> bool:
        """A checkpoint at every ``checkpoint.every`` steps and at the last one (0: none)."""
        every = self.plan.config.checkpoint.every
        return bool(every) and (step % every == 0 or step == self.plan.config.train.steps)

    # --- save ----------------------------------------------------------------------------------------

    def save(self, step: int, progress: dict, wait: bool = False) -> Path | None:
        """Checkpoint ``step``; asynchronous saves return before the checkpoint is committed unless
        ``wait``. Collective; raises ``CheckpointError`` on every rank if any rank failed to write it."""
        try:
            return self._save(step, progress, wait)
        except SaveFailed as exc:
            self._failed(exc)

    def _save(self, step: int, progress: dict, wait: bool) -> Path | None:
        if self.async_ckpt is None:
            return self._save_sync(step, progress)
        self.poll(wait=True)  # one save in flight at most
        trained, _ = self.plan.trainable_parameters()  # a LoRA checkpoint holds its adapters only
        if not self.async_ckpt.has_room(trained * CHECKPOINT_BYTES_PER_PARAM):
            self.metrics.note(f"{self.async_ckpt.root.parent} lacks room for a checkpoint: saving synchronously")
            return self._save_sync(step, progress)
        tic = time.perf_counter()
        snapshot = self.async_ckpt.snapshot_dir(step)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(snapshot, ignore_errors=True)
            snapshot.mkdir(parents=True)
        if self.rank == 0:
            self.manager.begin(step)
        dist.barrier()
        self._write_agreed(snapshot, step, progress, self.phase("save"))
        self.async_ckpt.start(step)
        self._log_save(step, tic, asynchronous=True)
        return self.poll(wait=True) if wait else None

    def poll(self, wait: bool = False) -> Path | None:
        """Commit a background save once every node has persisted it (collective); rank 0 gets its path."""
        if self.async_ckpt is None:
            return None
        try:
            final = self.async_ckpt.poll(wait=wait)
        except SaveFailed as exc:
            self._failed(exc)
        if final is not None:  # rank 0, which committed it
            self.hooks.after_commit(int(final.name.split("_")[-1]), final)
        return final

    def _save_sync(self, step: int, progress: dict) -> Path | None:
        tic = time.perf_counter()
        stage = self.manager.staging(step)
        if self.rank == 0:
            self.manager.begin(step)
        dist.barrier()
        beat = self.phase("save")
        self._write_agreed(stage, step, progress, beat)
        beat()
        final = None
        if self.rank == 0:
            final = self.manager.commit(step)
            self.hooks.after_commit(step, final)
            self.metrics.note(f"saved checkpoint {final.name}")
        dist.barrier()
        self._log_save(step, tic, asynchronous=False)
        return final

    def _write_agreed(self, stage: Path, step: int, progress: dict, beat) -> None:
        """``_write`` on every rank, then agree that every part was written (collective): a rank that
        could not write its part (a full disk, an I/O error) makes every rank raise ``SaveFailed``
        together, rather than leave its peers waiting in a barrier."""
        try:
            self._write(stage, step, progress, beat)
            outcome = None
        except Exception as exc:  # noqa: BLE001 - any failure to write means the checkpoint is not whole
            outcome = (describe_error(exc), self._full_disk(exc, stage))
        failed = device.tensor([int(outcome is not None)], dtype=torch.int32)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if failed.item():
            outcomes = [None] * dist.get_world_size()
            dist.all_gather_object(outcomes, outcome)
            raise SaveFailed(step, [o and o[0] for o in outcomes],
                             {rank: o[1] for rank, o in enumerate(outcomes) if o and o[1]})

    def _full_disk(self, exc: BaseException, where: Path) -> str | None:
        """Where a failed write found its disk full, whatever the writer said (torch's zip writer:
        ``unexpected pos``): measured now, before the partial checkpoint is removed. A disk with room
        for less than one checkpoint is full for this run."""
        trained, _ = self.plan.trainable_parameters()
        if not looks_full(exc, where, needed=trained * CHECKPOINT_BYTES_PER_PARAM):
            return None
        free = free_bytes(where)
        return f"{where.parent} ({human_bytes(free) if free is not None else 'unknown'} free)"

    def _failed(self, exc: SaveFailed) -> NoReturn:
        """A checkpoint not written whole is never committed: drop its staging folder (a full disk gets
        that space back), say which checkpoint a restart resumes from, and fail on every rank so that the
        agent restarts the job from it."""
        committed = self.manager.committed()
        kept = committed[-1].name if committed else None
        disk_full = bool(exc.full)
        message = (f"{exc}; it was not committed, and "
                   + (f"the newest complete checkpoint, {kept}, is kept: a restart resumes from it" if kept
                      else "there is no complete checkpoint yet: a restart starts over"))
        if disk_full:
            message += (f". The disk holding {', '.join(sorted(set(exc.full.values())))} is full: free space there, "
                        "or lower checkpoint.keep_last")
        if self.rank == 0:
            shutil.rmtree(self.manager.staging(exc.step), ignore_errors=True)
            from toolkit.watch.events import emit
            emit(self.run_dir, "checkpoint_failed", step=exc.step, kept=kept, disk_full=disk_full,
                 full={str(rank): where for rank, where in exc.full.items()},
                 errors={str(rank): e for rank, e in enumerate(exc.errors) if e})
            self.metrics.note(message)
        raise CheckpointError(message) from exc

    def _write(self, stage: Path, step: int, progress: dict, beat) -> None:
        """This rank's files of the checkpoint (engine state, RNG; rank 0 the descriptions); ``beat``
        after each file."""
        self.engine.save(stage / "engine", step, beat=beat)
        self.hooks.in_save(step)
        meta.rng_file(stage, self.rank).parent.mkdir(exist_ok=True)
        torch.save({**rng_state(), "engine": self.engine.rng_state()}, meta.rng_file(stage, self.rank))
        beat()
        if self.rank == 0:
            cfg, spec = self.plan.config, self.plan.model
            meta.write_descriptions(stage, cfg.backend, spec.model_type, spec.hf, self.engine.layout_record(),
                                    cfg.model.dtype, progress, run_id=self.run_id, **self.lora_meta)

    def _log_save(self, step: int, tic: float, asynchronous: bool) -> None:
        """How long the loop was blocked by this save (for async saves: the local write only)."""
        self.metrics.log({"event": "checkpoint", "step": step, "async": asynchronous,
                          "checkpoint_blocked_s": round(time.perf_counter() - tic, 4)})

    # --- resume --------------------------------------------------------------------------------------

    def resume(self) -> dict | None:
        """Load the newest complete checkpoint of this run (``checkpoint/lineage.py``) into the engine
        and this rank's RNG; its progress (trainer.json), or None when there is none. Collective.
        Raises ``RunDirError`` on every rank when the checkpoints there cannot be resumed (all
        damaged, another model's): a refusal, which the launcher does not restart."""
        newest = [None, None]  # rank 0's finding (a path, or a refusal), for every rank
        if self.rank == 0:
            first_attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) == 0
            verified = (os.environ.get(VERIFIED_ENV) or None) if first_attempt else None  # the launcher hashed it
            try:
                found = resume_checkpoint(self.run_dir, self.run_id, log=self._skipped, verified=verified)
                newest[0] = str(found) if found else None
            except RunDirError as exc:
                newest[1] = str(exc)
        dist.broadcast_object_list(newest, src=0)
        if newest[1]:
            raise RunDirError(newest[1])
        if newest[0] is None:
            self.metrics.note("no complete checkpoint found: starting fresh")
            return None
        ckpt = Path(newest[0])
        check_resumable(ckpt, self.plan)
        saved_meta = meta.read_meta(ckpt)
        saved_layout, progress = saved_meta["layout"], meta.read_progress(ckpt)
        self.phase("load" if saved_layout == self.engine.layout_record() else "reshard", progress["step"])
        engine_dir, loaded = engine_state_dir(ckpt, saved_layout, self.engine, self.plan.config.backend,
                                              self.run_dir, self.rank, note=self.metrics.note)
        self.engine.load(engine_dir)
        self.hooks.in_load(progress["step"])
        self.phase("load", progress["step"])
        drop_conversion(engine_dir, self.run_dir, self.rank)
        if loaded == "as saved":  # per-rank RNG streams only mean something for the same ranks
            state = torch.load(meta.rng_file(ckpt, self.rank), weights_only=True)
            set_rng_state(state)
            self.engine.set_rng_state(state.get("engine", {}))
        else:
            seed_everything(self.plan.config.train.seed + progress["step"])
        self.metrics.note(f"resumed from {ckpt.name} at step {progress['step']}")
        self.metrics.log({"event": "resume", "step": progress["step"], "checkpoint": ckpt.name, "loaded": loaded,
                          "saved_layout": saved_layout})
        return progress

    def _skipped(self, message: str) -> None:
        from toolkit.watch.events import emit
        self.metrics.note(message)
        emit(self.run_dir, "checkpoint_skipped", reason=message)


"""The one training loop, over any Engine: data order, LR schedule, eval, metrics, checkpoints.

Global batch k always holds the same samples (``data.global_batch_indices``), the step is the only
data position, and every rank's RNG state is checkpointed, so a resume continues bit for bit.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit import __version__
from toolkit.checkpoint import CheckpointManager, find_latest_complete
from toolkit.checkpoint.async_save import BYTES_PER_PARAM, AsyncCheckpointer, local_root
from toolkit.checkpoint.manager import write_json_durable
from toolkit.checkpoint.reshard import check_same_model, drop_conversion, engine_state_dir
from toolkit.config import RunConfig
from toolkit.data import (PackedData, count_loss_tokens, eval_micro_batches, global_batch_indices,
                          rank_micro_batches)
from toolkit.engine import Engine
from toolkit.flops import flops_per_token, mfu, peak_flops
from toolkit.metrics import MetricsLogger
from toolkit.parallel import rng_state, seed_everything, set_rng_state
from toolkit.profile import StepProfiler, write_summary
from toolkit.restart.agent import PREEMPTED_EXIT
from toolkit.restart.events import emit, read_events
from toolkit.restart.faults import FaultInjector
from toolkit.restart.monitor import RankMonitor
from toolkit.schedule import lr_at


class Trainer:
    def __init__(self, cfg: RunConfig, engine: Engine, data: PackedData, tokenizer, hf_config, run_dir: Path):
        self.cfg, self.engine, self.data = cfg, engine, data
        self.tokenizer, self.hf_config = tokenizer, hf_config
        self.run_dir = Path(run_dir)
        self.rank = dist.get_rank()
        self.ckpt = CheckpointManager(self.run_dir, cfg.checkpoint.keep_last)
        self.step = 0
        self.skipped_steps = 0  # fp16 steps whose update the loss scaler skipped (kept across resumes)
        self.metrics = MetricsLogger(self.run_dir, cfg.train.steps, enabled=self.rank == 0,
                                     log_every=cfg.train.log_every, wandb_project=cfg.metrics.wandb_project,
                                     run_config=cfg.model_dump(mode="json"))
        p = cfg.profile
        self.profiler = StepProfiler(self.run_dir, self.rank, p.start_step, p.steps) if p.enabled else None
        self._peak = peak_flops(cfg.model.dtype, tf32=cfg.model.tf32)  # None on CPU: no MFU there
        self._flops_per_token = flops_per_token(hf_config, cfg.data.seq_len) if self._peak else None
        self.faults = FaultInjector(self.run_dir, self.rank)
        self.monitor = RankMonitor(self.run_dir, cfg.restart, log=self.metrics.note)
        self._restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._recovering = self._restart_count > 0
        self.async_ckpt = None
        if cfg.checkpoint.async_save:
            self.async_ckpt = AsyncCheckpointer(
                self.ckpt, local_root(cfg.checkpoint.local_dir, self.run_dir),
                int(os.environ.get("LOCAL_RANK", "0")), log=self.metrics.note,
                on_file=lambda rel: self.faults.in_persist(self.async_ckpt.pending))

    # --- the loop ---------------------------------------------------------------------------------

    def fit(self) -> None:
        if self.async_ckpt is not None:
            self.async_ckpt.clear_stale()
        if self.cfg.resume == "auto":
            self.resume()
        self.monitor.heartbeat.beat(self.step, "ready")
        t = self.cfg.train
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=1) as prefetch, self.metrics:
            upcoming = prefetch.submit(self._batch, self.step)
            while self.step < t.steps:
                tic = time.perf_counter()
                micro_batches, loss_tokens = upcoming.result()
                if self.step + 1 < t.steps:  # load the next global batch while this one computes
                    upcoming = prefetch.submit(self._batch, self.step + 1)
                self.faults.step_delay(self.step + 1)
                self.faults.before_step(self.step + 1, params=self.engine.parameters)
                self.monitor.add_busy(time.perf_counter() - tic)
                if self.profiler:
                    self.profiler.before_step(self.step + 1)
                stats = self.engine.train_step(micro_batches, loss_tokens, lr_at(self.step, t))
                self.step += 1
                self._after_profiled_step()
                self.monitor.add_busy(stats.compute_s)
                self._log_step(stats, time.perf_counter() - tic, time.perf_counter() - start)
                self._after_step()
        if self.cfg.train.export_hf:
            self.engine.export_hf(self.run_dir / "hf_final", self.tokenizer)
        self._poll_async(wait=True)  # the last checkpoint is committed before we report success

    def _after_step(self) -> None:
        """Health checks, eval, preemption and checkpoints at the step boundary."""
        self.monitor.heartbeat.beat(self.step)
        self._note_recovery()
        self.faults.after_step(self.step, params=self.engine.parameters)
        self._poll_async()  # commits a background save once every node has persisted it
        self.monitor.check_stragglers(self.step)
        self.monitor.check_divergence(self.step, self.engine)
        t = self.cfg.train
        if t.eval_every and self.step % t.eval_every == 0:
            self.evaluate()
        if self.monitor.stop_agreed():
            self.save(wait=True)
            if self.rank == 0:
                emit(self.run_dir, "preempt_saved", step=self.step)
                self.metrics.note(f"stop requested: saved step {self.step}, exiting with {PREEMPTED_EXIT}")
            sys.exit(PREEMPTED_EXIT)
        every = self.cfg.checkpoint.every
        if every and (self.step % every == 0 or self.step == t.steps):
            self.save()

    def _after_profiled_step(self) -> None:
        if self.profiler and self.profiler.after_step(self.step):
            dist.barrier()  # every rank's summary is written
            if self.rank == 0:
                self.metrics.note(f"profile of steps {self.profiler.start}-{self.step}: "
                                  f"{write_summary(self.profiler.dir)}")

    def _note_recovery(self) -> None:
        """After a restart, the first finished step closes the recovery: measure it."""
        if self._recovering and self.rank == 0:
            failures = [e for e in read_events(self.run_dir) if e["kind"] in ("failure", "hang")]
            since = time.time() - failures[-1]["time"] if failures else None
            emit(self.run_dir, "recovered", step=self.step, restart_count=self._restart_count,
                 time_to_recover_s=round(since, 2) if since is not None else None)
        self._recovering = False

    def _batch(self, step: int):
        ds, t = self.data.train, self.cfg.train
        indices = global_batch_indices(len(ds), t.global_batch_size, t.seed, step)
        micro = rank_micro_batches(ds, indices, self.engine.dp_rank, self.engine.dp_size, t.micro_batch_size)
        return micro, count_loss_tokens(ds, indices)

    def _log_step(self, stats, step_s: float, elapsed_s: float) -> None:
        t = self.cfg.train
        tokens = t.global_batch_size * self.cfg.data.seq_len
        record = {"step": self.step, "loss": stats.loss, "lr": lr_at(self.step - 1, t),
                  "grad_norm": stats.grad_norm, "tokens": tokens, "tokens_per_s": tokens / step_s,
                  "step_s": step_s, "elapsed_s": elapsed_s}
        if stats.loss_scale is not None:  # fp16: dynamic loss scaling
            self.skipped_steps += stats.skipped
            record.update(loss_scale=stats.loss_scale, skipped=stats.skipped, skipped_steps=self.skipped_steps)
        record.update(stats.extra)
        if self._peak:  # GPUs only; the formula and peaks: toolkit/flops.py
            record["mfu"] = mfu(tokens / step_s / dist.get_world_size(), self._flops_per_token, self._peak)
        self.metrics.log(record)

    def evaluate(self) -> float | None:
        if self.data.eval is None or len(self.data.eval) == 0:
            return None
        t = self.cfg.train
        batches = eval_micro_batches(self.data.eval, self.engine.dp_rank, self.engine.dp_size,
                                     t.micro_batch_size, t.eval_batches)
        loss_sum, count = self.engine.eval_loss_sum(batches)
        loss = loss_sum / max(count, 1)
        self.metrics.log({"step": self.step, "eval_loss": loss, "eval_tokens": count})
        return loss

    # --- checkpoints ------------------------------------------------------------------------------

    def save(self, wait: bool = False) -> Path | None:
        """Checkpoint this step; asynchronous saves return before the checkpoint is committed
        unless ``wait``. Collective."""
        if self.async_ckpt is None:
            return self._save_sync()
        self._poll_async(wait=True)  # one save in flight at most
        if not self.async_ckpt.has_room(self._checkpoint_bytes()):
            self.metrics.note(f"{self.async_ckpt.root.parent} lacks room for a checkpoint: saving synchronously")
            return self._save_sync()
        tic = time.perf_counter()
        snapshot = self.async_ckpt.snapshot_dir(self.step)
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(snapshot, ignore_errors=True)
            snapshot.mkdir(parents=True)
        if self.rank == 0:
            self.ckpt.begin(self.step)
        dist.barrier()
        self._write_snapshot(snapshot)
        dist.barrier()
        self.async_ckpt.start(self.step)
        self._log_save(tic, asynchronous=True)
        return self._poll_async(wait=True) if wait else None

    def _poll_async(self, wait: bool = False) -> Path | None:
        if self.async_ckpt is None:
            return None
        final = self.async_ckpt.poll(wait=wait)
        if final is not None:  # rank 0, which committed it
            self.faults.after_commit(int(final.name.split("_")[-1]), final)
        return final

    def _log_save(self, tic: float, asynchronous: bool) -> None:
        """How long the loop was blocked by this save (for async saves: the local write only)."""
        self.metrics.log({"event": "checkpoint", "step": self.step, "async": asynchronous,
                          "checkpoint_blocked_s": round(time.perf_counter() - tic, 4)})

    def _save_sync(self) -> Path:
        tic = time.perf_counter()
        stage = self.ckpt.staging(self.step)
        if self.rank == 0:
            self.ckpt.begin(self.step)
        dist.barrier()
        self._write_snapshot(stage)
        dist.barrier()
        final = None
        if self.rank == 0:
            final = self.ckpt.commit(self.step)
            self.faults.after_commit(self.step, final)
            self.metrics.note(f"saved checkpoint {final.name}")
        dist.barrier()
        self._log_save(tic, asynchronous=False)
        return final

    def _write_snapshot(self, stage: Path) -> None:
        """This rank's files of the checkpoint (engine state, RNG; rank 0 the descriptions) into ``stage``."""
        self.monitor.heartbeat.beat(self.step, "saving")
        self.engine.save(stage / "engine", self.step)
        self.faults.in_save(self.step)
        (stage / "trainer").mkdir(exist_ok=True)
        torch.save({**rng_state(), "engine": self.engine.rng_state()}, stage / "trainer" / f"rank_{self.rank:05d}.pt")
        if self.rank == 0:
            self._write_descriptions(stage)

    def _checkpoint_bytes(self) -> float:
        if not hasattr(self, "_ckpt_bytes"):
            from toolkit.estimate import model_shape
            self._ckpt_bytes = model_shape(self.hf_config).total * BYTES_PER_PARAM
        return self._ckpt_bytes

    def _write_descriptions(self, stage: Path) -> None:
        t = self.cfg.train
        write_json_durable(stage / "trainer.json", {
            "step": self.step, "consumed_samples": self.step * t.global_batch_size,
            "consumed_tokens": self.step * t.global_batch_size * self.cfg.data.seq_len, "seed": t.seed,
            "skipped_steps": self.skipped_steps})
        write_json_durable(stage / "meta.json", {
            "format": f"toolkit-{self.cfg.backend}", "family": self.hf_config.model_type,
            "step": self.step, "layout": self.engine.layout(), "vocab_size": self.hf_config.vocab_size,
            "dtype": self.cfg.model.dtype, "toolkit_version": __version__,
            "torch_version": torch.__version__})
        self.hf_config.to_json_file(str(stage / "config.json"))

    def resume(self) -> None:
        found = find_latest_complete(self.run_dir, log=self._checkpoint_skipped) if self.rank == 0 else None
        box = [str(found) if found else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            self.metrics.note("no complete checkpoint found: starting fresh")
            return
        ckpt = Path(box[0])
        check_same_model(ckpt, self.hf_config)
        saved_layout = json.loads((ckpt / "meta.json").read_text())["layout"]
        engine_dir, loaded = engine_state_dir(ckpt, saved_layout, self.engine, self.cfg.backend, self.run_dir,
                                              self.rank, note=self.metrics.note)
        self.engine.load(engine_dir)
        drop_conversion(engine_dir, self.run_dir, self.rank)
        progress = json.loads((ckpt / "trainer.json").read_text())
        self.step, self.skipped_steps = progress["step"], progress.get("skipped_steps", 0)
        if loaded == "as saved":  # per-rank RNG streams only mean something for the same ranks
            state = torch.load(ckpt / "trainer" / f"rank_{self.rank:05d}.pt", weights_only=True)
            set_rng_state(state)
            self.engine.set_rng_state(state.get("engine", {}))
        else:
            seed_everything(self.cfg.train.seed + self.step)
        self.metrics.note(f"resumed from {ckpt.name} at step {self.step}")
        self.metrics.log({"event": "resume", "step": self.step, "checkpoint": ckpt.name, "loaded": loaded,
                          "saved_layout": saved_layout})

    def _checkpoint_skipped(self, message: str) -> None:
        self.metrics.note(message)
        emit(self.run_dir, "checkpoint_skipped", reason=message)

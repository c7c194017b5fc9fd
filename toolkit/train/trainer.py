"""The one training loop, over any Engine: data order, LR schedule, eval, metrics; checkpoints,
health checks and fault hooks are calls at named points.

Global batch k always holds the same samples (``data.batches.batch_indices``), the step is the only
data position, and every rank's RNG state is checkpointed, so a resume continues bit for bit.
"""
from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch.distributed as dist

from toolkit.checkpoint.checkpointer import Checkpointer
from toolkit.config import ConfigError
from toolkit.data import PackedData, batch_counts, eval_micro_batches, rank_micro_batches
from toolkit.data.batches import batch_indices, tokens_by_source
from toolkit.engine import Engine, StepStats
from toolkit.estimate.flops import flops_per_token, mfu, peak_flops
from toolkit.objectives import Prepared
from toolkit.observe.metrics import MetricsLogger
from toolkit.observe.profile import StepProfiler, write_summary
from toolkit.plan import Plan
from toolkit.syncs import strict_sync_counter
from toolkit.train.schedule import lr_at
from toolkit.watch.events import emit, read_events
from toolkit.watch.faults import FaultInjector
from toolkit.watch.heartbeat import Heartbeat
from toolkit.watch.monitor import RankMonitor
from toolkit.watch.protocol import PREEMPTED_EXIT


def stream_position(progress: dict) -> dict:
    """The stream position a checkpoint's trainer.json recorded; a refusal (before any step) when the
    checkpoint was saved without ``data.streaming``, whose position a stream cannot continue from."""
    if "data_stream" not in progress:
        raise ConfigError(f"data.streaming=true, but the checkpoint of step {progress['step']} was saved by a run "
                          "that did not stream: it records no position in the stream to continue from. Resume "
                          "with data.streaming=false, or start over with --resume never")
    return progress["data_stream"]


class Trainer:
    """One rank's training loop over any ``Engine`` (``toolkit.build_engine``): ``fit()`` trains
    ``plan.config.train.steps`` global batches of ``data`` (``PackedData``), resuming from ``run_dir``'s
    newest complete checkpoint of its run (``checkpoint/lineage.py``) when ``resume=auto`` and on every
    restart, and writes ``run_dir``/metrics.jsonl, checkpoints and ``run_dir``/hf_final (``train.export_hf``).
    Needs the job's process group."""

    def __init__(self, plan: Plan, engine: Engine, data: PackedData, tokenizer, run_dir: Path,
                 heartbeat: Heartbeat | None = None):
        """``heartbeat``: the rank's, beating ``load`` since its start (``train.worker``)."""
        self.plan, self.cfg, self.engine, self.data, self.tokenizer = plan, plan.config, engine, data, tokenizer
        self.run_dir, self.rank = Path(run_dir), dist.get_rank()
        cfg = self.cfg
        self.step = 0
        self.skipped_steps = 0  # fp16 steps whose update the loss scaler skipped (kept across resumes)
        self.metrics = MetricsLogger(self.run_dir, cfg.train.steps, enabled=self.rank == 0,
                                     log_every=cfg.train.log_every, wandb_project=cfg.metrics.wandb_project,
                                     run_config=cfg.model_dump(mode="json"))
        p = cfg.profile
        self.profiler = StepProfiler(self.run_dir, self.rank, p.start_step, p.steps) if p.enabled else None
        self._peak = peak_flops(cfg.model.dtype, tf32=cfg.model.tf32)  # None on CPU: no MFU there
        self._flops_per_token = flops_per_token(plan.model, cfg.data.seq_len)
        self.hooks = FaultInjector(self.run_dir, self.rank, params=engine.parameters)
        self.monitor = RankMonitor(self.run_dir, cfg.restart, log=self.metrics.note, heartbeat=heartbeat)
        self.checkpoints = Checkpointer(plan, engine, self.run_dir, self.rank, self.metrics, self.hooks,
                                        phase=self._phase)
        self._restart_count = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
        self._recovering = self._restart_count > 0
        self._resumed_at = None
        self.objective = plan.objective
        self.reference: Prepared | None = None
        """What the objective's hook made before any load (a reference model's scores), attached to each batch."""

    # --- the loop ---------------------------------------------------------------------------------

    def fit(self) -> None:
        self._log_parameters()
        # before a checkpoint loads: the engine still holds the starting model
        self.reference = self.objective.prepare(self.cfg, self.engine, self.data, log=self.metrics.note,
                                                phase=self._phase)
        if self.cfg.resume == "auto" or self._recovering:  # a restart continues this run, --resume never too
            self._phase("load")
            self.resume()
        self.monitor.heartbeat.beat(self.step, "ready")
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=1) as prefetch, self.metrics:
            upcoming = prefetch.submit(self._batch, self.step)
            while self.step < self.cfg.train.steps:
                tic = time.perf_counter()
                micro_batches, counts = upcoming.result()
                if self.step + 1 < self.cfg.train.steps:  # load the next global batch while this one computes
                    upcoming = prefetch.submit(self._batch, self.step + 1)
                stats = self._train_step(micro_batches, counts[self.objective.count], tic)
                self._log_step(stats, counts, time.perf_counter() - tic, time.perf_counter() - start)
                self._after_step()
        if self.cfg.train.export_hf:
            self.engine.export_hf(self.run_dir / "hf_final", self.tokenizer, beat=self._phase("export"))
            if self.data.images is not None and dist.get_rank() == 0:  # a vision-language model's processor
                self.data.images.copy_processor_files(self.run_dir / "hf_final")
        self.checkpoints.poll(wait=True)  # the last checkpoint is committed before we report success

    def _log_parameters(self) -> None:
        """What trains, from the plan: the whole model, or a LoRA run's adapters (and modules to save)."""
        trainable, total = self.plan.trainable_parameters()
        self.metrics.note(f"parameters: {trainable:,} trainable of {total:,} ({100 * trainable / total:.2f}%)"
                          + (f"; LoRA rank {self.plan.lora.rank} on {self.plan.lora.adapted} layers" if self.plan.lora
                             else ""))
        self.metrics.log({"event": "parameters", "trainable_params": trainable, "total_params": total})
        for record in getattr(self.engine, "setup_records", ()):  # choices the engine made on this machine
            self.metrics.log(record)
        self._log_packing()

    def _log_packing(self) -> None:
        """How rows were made (``toolkit/data``) and what it cost: long documents split or dropped."""
        d, data = self.cfg.data, self.data
        line = f"data.packing={data.packing}: {data.num_documents:,} documents -> {len(data.train):,} train rows"
        if data.packing != "concat":
            handled = "split" if d.overflow == "split" and data.images is None else "dropped"  # images: dropped
            line += f"; {data.num_overflow:,} longer than data.seq_len={d.seq_len} ({handled})"
        if data.num_identical_pairs:  # no margin to learn from (toolkit/data/templates.py)
            line += (f"; {data.num_identical_pairs:,} of {data.num_pairs:,} pairs dropped: their chosen and "
                     "rejected answers are the same")
        self.metrics.note(line)
        self.metrics.log({"event": "packing", "packing": data.packing, "documents": data.num_documents,
                          "train_rows": len(data.train), "overflow_documents": data.num_overflow,
                          "overflow": d.overflow if data.images is None else "drop",
                          "identical_pairs": data.num_identical_pairs})

    def _train_step(self, micro_batches, loss_tokens: int, tic: float) -> StepStats:
        # the step's own phase from its start: the eval or save before it beat theirs, whose budgets
        # (minutes for a big model's save) must not judge a hang in this step
        self.monitor.heartbeat.beat(self.step, "step")
        self.hooks.before_step(self.step + 1)
        self.monitor.add_busy(time.perf_counter() - tic)  # data wait (and an injected delay) count as busy
        if self.profiler:
            self.profiler.before_step(self.step + 1)
        with strict_sync_counter() as syncs:
            stats = self.engine.train_step(micro_batches, loss_tokens, lr_at(self.step, self.cfg.train))
        if syncs is not None:  # strict mode: what would make a GPU's host wait (toolkit/syncs.py)
            stats.extra["host_syncs"] = syncs.total
        self.step += 1
        self._after_profiled_step()
        self.monitor.add_busy(stats.compute_s)
        return stats

    def _after_step(self) -> None:
        """Health checks, eval, preemption and checkpoints at the step boundary."""
        self.monitor.heartbeat.beat(self.step)
        self._note_recovery()
        self.hooks.after_step(self.step)
        self.checkpoints.poll()  # commits a background save once every node has persisted it
        self.monitor.check_stragglers(self.step)
        self.monitor.check_divergence(self.step, self.engine)
        t = self.cfg.train
        if t.eval_every and self.step % t.eval_every == 0:
            self.evaluate()
        if self.monitor.stop_agreed():
            self._save_and_stop()
        if self.checkpoints.due(self.step):
            self.save()

    def _save_and_stop(self) -> None:
        self.save(wait=True)
        if self.rank == 0:
            emit(self.run_dir, "preempt_saved", step=self.step)
            self.metrics.note(f"stop requested: saved step {self.step}, exiting with {PREEMPTED_EXIT}")
        sys.exit(PREEMPTED_EXIT)

    def _after_profiled_step(self) -> None:
        if self.profiler and self.profiler.after_step(self.step):
            dist.barrier()  # every rank's summary is written
            if self.rank == 0:
                self.metrics.note(f"profile of steps {self.profiler.start}-{self.step}: "
                                  f"{write_summary(self.profiler.dir)}")

    def _note_recovery(self) -> None:
        """After a restart, the first finished step closes the recovery: measure it, and where its
        time went (``breakdown_s``)."""
        if self._recovering and self.rank == 0:
            events = read_events(self.run_dir)
            failures = [e for e in events if e["kind"] in ("failure", "hang")]
            since = time.time() - failures[-1]["time"] if failures else None
            emit(self.run_dir, "recovered", step=self.step, restart_count=self._restart_count,
                 time_to_recover_s=round(since, 2) if since is not None else None,
                 breakdown_s=self._recovery_breakdown(events))
        self._recovering = False

    def _recovery_breakdown(self, events: list[dict]) -> dict | None:
        """Seconds from the failure's detection (the agent's ``restarted`` event: backoff, ranks torn
        down, rendezvous, ranks started) to this rank up, its process group, data and engine ready
        (``Heartbeat.mark``), its checkpoint loaded, its first step done."""
        restarted = [e for e in events if e["kind"] == "restarted"]
        if not restarted:
            return None
        detected = restarted[-1]["detected_at"]
        marks = {k[:-2]: v for k, v in restarted[-1].items() if k.endswith("_s")}
        heartbeat = self.monitor.heartbeat
        marks.update(rank_up=heartbeat.started_at - detected,
                     **{stage: at - detected for stage, at in heartbeat.marks.items()},
                     checkpoint_loaded=(self._resumed_at or time.time()) - detected,
                     first_step_done=time.time() - detected)
        return {k: round(v, 3) for k, v in marks.items()}

    def _batch(self, step: int):
        ds, t = self.data.train, self.cfg.train
        if self.data.stream is not None:  # data.streaming: the batch's own rows, made as the run trains
            ds = self.data.stream.global_batch(step, t.global_batch_size)
        indices = list(range(len(ds))) if self.data.stream is not None else \
            batch_indices(self.data, t.global_batch_size, t.seed, step)
        micro = rank_micro_batches(ds, indices, self.engine.dp_rank, self.engine.dp_size, t.micro_batch_size,
                                   self.data.images)
        if self.reference:
            per_rank = len(indices) // self.engine.dp_size
            micro = self.reference.attach("train", micro, indices[self.engine.dp_rank * per_rank:][:per_rank], indices)
        return micro, {**batch_counts(ds, indices), "by_source": tokens_by_source(self.data, indices)}

    def _log_step(self, stats: StepStats, counts: dict, step_s: float, elapsed_s: float) -> None:
        """``tokens``: row tokens (global batch x seq_len, padding included); ``packing_efficiency``:
        the share that is document tokens; ``documents_per_row`` (packing documents/pad): documents
        (or split pieces) per row."""
        t = self.cfg.train
        tokens = t.global_batch_size * self.cfg.data.seq_len
        record = {"step": self.step, "loss": stats.loss, "lr": lr_at(self.step - 1, t),
                  "grad_norm": stats.grad_norm, "tokens": tokens, "tokens_per_s": tokens / step_s,
                  "packing_efficiency": counts["tokens"] / tokens, "step_s": step_s, "elapsed_s": elapsed_s}
        if counts["documents"] is not None:  # rows packed by documents count them
            record["documents_per_row"] = counts["documents"] / t.global_batch_size
        if counts.get("by_source") is not None:  # a blend (data.weights): document tokens per source
            record["tokens_by_source"] = counts["by_source"]
        if self.objective.logged_count:  # the loss is the mean over these (pairs); the objective's metrics: extra
            record[self.objective.logged_count] = counts[self.objective.count]
        if stats.loss_scale is not None:  # fp16: dynamic loss scaling
            self.skipped_steps += stats.skipped
            record.update(loss_scale=stats.loss_scale, skipped=stats.skipped, skipped_steps=self.skipped_steps)
        record.update(stats.extra)
        if self._peak:  # GPUs only; the formula and peaks: toolkit/estimate/flops.py
            record["mfu"] = mfu(tokens / step_s / dist.get_world_size(), self._flops_per_token, self._peak)
        self.metrics.log(record)

    def evaluate(self) -> float | None:
        if self.data.eval is None or len(self.data.eval) == 0:
            return None
        t = self.cfg.train
        dp_rank, dp_size = self.engine.dp_rank, self.engine.dp_size
        batches = eval_micro_batches(self.data.eval, dp_rank, dp_size, t.micro_batch_size, t.eval_batches,
                                     self.data.images)
        if self.reference:  # eval_micro_batches: the first rows, in order, split over the ranks
            n = len(batches) * t.micro_batch_size
            batches = self.reference.attach("eval", batches, list(range(dp_rank * n, (dp_rank + 1) * n)),
                                            list(range(dp_size * n)))
        tic = time.perf_counter()
        loss_sum, count = self.engine.eval_loss_sum(batches, beat=self._phase("eval"))
        loss = loss_sum / max(count, 1)
        self.metrics.log({"step": self.step, "eval_loss": loss, self.objective.eval_count: count,
                          "eval_s": round(time.perf_counter() - tic, 3), **getattr(self.engine, "eval_metrics", {})})
        return loss

    def _phase(self, phase: str, step: int | None = None) -> Callable[[], None]:
        """Beat ``phase`` (``watch.heartbeat.PHASES``) now, at ``step`` (a resume: the checkpoint's;
        default the loop's); the callable returned is called after each unit of the phase's work (a
        micro-batch, a file, a tensor) and beats again, so long healthy work is never taken for a
        hang while a stuck one still is (an injected ``slow_<phase>`` fault delays each unit)."""
        self.monitor.heartbeat.beat(self.step if step is None else step, phase)

        def beat() -> None:
            self.hooks.in_progress(phase, self.step)
            self.monitor.heartbeat.progress()
        return beat

    # --- checkpoints (toolkit/checkpoint/checkpointer.py) -------------------------------------------

    def save(self, wait: bool = False) -> Path | None:
        return self.checkpoints.save(self.step, self._progress(), wait=wait)

    def resume(self) -> None:
        progress = self.checkpoints.resume()
        self._resumed_at = time.time()
        if progress is not None and self.reference:
            self.reference.check_resumed(progress.get("reference"))
        if progress is not None:
            self.step, self.skipped_steps = progress["step"], progress.get("skipped_steps", 0)
            if self.data.stream is not None and self.step:  # continue the stream where the checkpoint was
                self.data.stream.seek(stream_position(progress), self.step)

    def _progress(self) -> dict:
        """trainer.json: where the loop is (the schema: toolkit/storage/meta.py)."""
        t = self.cfg.train
        return {"step": self.step, "consumed_samples": self.step * t.global_batch_size,
                "consumed_tokens": self.step * t.global_batch_size * self.cfg.data.seq_len, "seed": t.seed,
                "skipped_steps": self.skipped_steps,
                **({"reference": self.reference.key} if self.reference and self.reference.key else {}),
                **({"data_stream": self.data.stream.position(self.step)} if self.data.stream is not None else {})}

"""The Engine protocol over megatron-core: GPTModel chunks from the plan, DDP (grads reduced in fp32
buckets), the distributed optimizer, steps through ``get_forward_backward_func``.

Loss contract (same as the DeepSpeed path): the gradient is that of ``sum(token losses of the global
batch) / loss_tokens``. Megatron is run with ``calculate_per_token_loss=True`` so neither the
schedule (which would divide by the number of micro-batches) nor DDP (which would divide by dp)
rescales; each micro-batch's backward starts from its loss sum / loss_tokens (as the HF path's
does; a plain sum would make every token's logit gradient loss-scale sized and overflow fp16 at
the usual 2^16 scale), and the DP all-reduce sums the ranks' parts. Under context parallelism
(``megatron.cp``) each CP rank takes its chunks of every row (``context.py``) and the loss of its
tokens; DDP sums the gradients over dp x cp, and the reported loss sums over every rank, each
token counted on the one rank that holds it. Padded vocabulary columns get
-inf logits before the vocab-parallel cross entropy, so they never reach the loss.
"""
from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from toolkit import device
from toolkit.adapters.megatron import context, experts, export, grid, lora, state
from toolkit.adapters.megatron.attention import TokenLayout, describe_kernels
from toolkit.adapters.megatron.model import (
    attention_options,
    build_chunks,
    load_balanced_router_class,
    transformer_config,
)
from toolkit.adapters.megatron.weights import (
    check_hf_keys,
    checkpoint_names,
    hf_weights,
    load_hf_into_chunk,
    release_storage,
)
from toolkit.compat import megatron_core
from toolkit.config import ConfigError
from toolkit.engine import DTYPES, StepStats
from toolkit.loss import IGNORE_INDEX
from toolkit.objectives import document_sums
from toolkit.plan import Plan
from toolkit.watch.budgets import plan_collective_timeout_s


class MegatronEngine:
    """The Engine protocol over megatron-core GPTModel chunks, DDP and the distributed optimizer."""

    def __init__(self, plan: Plan, hf_state: Mapping[str, torch.Tensor] | None = None,
                 adapters: Mapping[str, torch.Tensor] | None = None):
        """This rank's part of the planned model at the layout for this job's world size; weights from
        ``hf_state`` (an HF state dict) or, by default, as the plan says (model.init). A LoRA run's
        adapters (``lora.py``): ``adapters`` (HF-PEFT names, HF shapes), by default peft's init."""
        from toolkit.families import get_family
        megatron_core.bind_missing_te_names()
        if not torch.cuda.is_available():  # never imported on a GPU machine
            from toolkit.compat import megatron_cpu
            megatron_cpu.enable()  # stays on for the process: megatron allocates lazily, also in backward
        self.cfg, self.lay = plan.config, plan.layout(dist.get_world_size())
        self.hf_config = plan.model.hf_config()
        self.family = get_family(self.hf_config.model_type)
        check_machine(plan)
        self._init_parallel(plan_collective_timeout_s(plan))
        hf_state = hf_weights(plan, self.hf_config) if hf_state is None else \
            checkpoint_names(self.family, self.hf_config, hf_state)
        check_hf_keys(self.family, self.hf_config, hf_state)
        self.tconfig = transformer_config(self.cfg, self.lay, self.hf_config, self.family)
        self.attention = attention_options(self.cfg, self.hf_config, self.family, self.tconfig)
        self.experts_implementation, self.setup_records = self._choose_experts()
        chunks = build_chunks(self.lay, self.hf_config, self.family, self.tconfig, self.attention,
                              self.experts_implementation)
        for c in chunks:  # the weights are loaded into DDP's buffer, not copied there (weights.py)
            release_storage(c)
        if torch.cuda.is_available():  # the released blocks back to the driver: DDP's buffer is one block
            torch.cuda.empty_cache()
        self.lora = plan.lora
        self.objective, self.eval_metrics = plan.objective, {}
        if self.lora is not None:
            self._attach_lora(chunks, adapters)
            self._experts_under_lora(chunks)
        for c in chunks:
            device.guard_inputs(c, "megatron's GPTModel")
        self.model = self._wrap_ddp(chunks)
        for c in chunks:
            load_hf_into_chunk(c, self.family, self.hf_config, hf_state, self.lay, self.tp_rank)
        del hf_state
        self.optimizer = self._build_optimizer()
        self._configure_schedule()
        self._setup_routers()

    # --- setup ----------------------------------------------------------------------------------------

    def _init_parallel(self, timeout_s: float) -> None:
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
        place = grid.initialize(self.lay, timeout_s)
        model_parallel_cuda_manual_seed(self.cfg.train.seed)
        self.tp_rank, self.pp_rank, self.dp_rank = place.tp_rank, place.pp_rank, place.dp_rank
        self.cp_rank, self.cp_group = place.cp_rank, grid.cp_group() if self.lay.cp > 1 else None
        self.dp_size = self.lay.dp  # CP ranks of a DP replica take the same samples
        self.is_last_stage = self.pp_rank == self.lay.pp - 1  # the last stage, virtual stages aside
        # whether this rank's copy of dense / expert parameters is the one an export takes
        self.owns_dense = self.dp_rank == 0 and self.cp_rank == 0
        self.owns_experts = place.expert_dp_rank == 0

    def _choose_experts(self) -> tuple[str, list[dict]]:
        """MoE: ``grouped_mm`` (``experts.py``'s grouped module) or ``eager`` (megatron's ``SequentialMLP``)
        for ``model.experts_implementation``, and its record for metrics.jsonl (why ``auto`` fell back)."""
        if not self.family.num_experts(self.hf_config):
            return experts.EAGER, []
        requested = self.cfg.model.experts_implementation
        chosen, reason = experts.choose(requested, self.tconfig)
        return chosen, [{"event": "experts", "experts_implementation": chosen, "requested": requested,
                         "fallback_reason": reason}]

    def _experts_under_lora(self, chunks) -> None:
        """LoRA adapters on the expert linears (forward hooks): the grouped module runs its experts one
        by one, hooks included (``experts.py``); the record says so."""
        grouped = experts.grouped_sequential_mlp_class()
        if any(isinstance(m, grouped) and m.hooked() for c in chunks for m in c.modules()):
            self.experts_implementation = experts.EAGER
            self.setup_records[0].update(experts_implementation=experts.EAGER,
                                         fallback_reason="LoRA adapters on the experts' linears")

    def _attach_lora(self, chunks, adapters) -> None:
        """The base frozen, this rank's slices of the adapters on its linears (``lora.py``; drawn as the
        DeepSpeed path draws them where ``adapters`` is None)."""
        if adapters is None:
            from toolkit.lora.peft import draw_adapters
            adapters = draw_adapters(self.hf_config, self.lora, self.cfg.train.seed)
        lora.attach(chunks, self.family, self.hf_config, self.lora, adapters, self.lay, self.tp_rank)

    def _wrap_ddp(self, chunks) -> list:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                   use_distributed_optimizer=True, check_for_nan_in_grad=False)
        return [DistributedDataParallel(self.tconfig, ddp_config, c,
                                        disable_bucketing=i > 0) for i, c in enumerate(chunks)]

    def _build_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        t, dtype = self.cfg.train, self.cfg.model.dtype
        ocfg = OptimizerConfig(optimizer="adam", lr=t.lr, min_lr=t.min_lr, weight_decay=t.weight_decay,
                               adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2, adam_eps=t.adam_eps,
                               clip_grad=t.grad_clip, use_distributed_optimizer=True,
                               bf16=dtype == "bf16", fp16=dtype == "fp16", params_dtype=DTYPES[dtype],
                               initial_loss_scale=self.cfg.megatron.initial_loss_scale)
        return get_megatron_optimizer(ocfg, self.model)

    def _setup_routers(self) -> None:
        """MoE: the routers record their statistics in one ``RouterStats`` (layers by global number)."""
        from toolkit.adapters import moe
        experts = self.family.num_experts(self.hf_config)
        self.routers = [m for c in self.model for m in c.modules() if isinstance(m, load_balanced_router_class())]
        self.router_stats = moe.RouterStats(self.hf_config.num_hidden_layers, experts) if experts else None
        self.aux_coeff = moe.aux_loss_coeff(self.cfg.train.moe_aux_loss_coeff, self.hf_config)
        for router in self.routers:
            router.stats = self.router_stats

    def _set_aux_scale(self, micro_batches: int) -> None:
        """Weight of each micro-batch's layer aux loss so that, after the DP sum, the objective gets
        ``coeff`` x the mean over MoE layers and the global batch's micro-batches (``toolkit/adapters/moe.py``)."""
        if not self.routers:
            return
        per = self.aux_coeff / (self.hf_config.num_hidden_layers * micro_batches * self.dp_size)
        if not per:
            per = None
        elif self.tconfig.grad_scale_func is not None:  # fp16: megatron scales the loss up, every grad down
            per = per * self.optimizer.get_loss_scale()  # a device tensor: not read on the host
        for router in self.routers:
            router.aux_scale = per

    def _configure_schedule(self) -> None:
        from megatron.core.distributed import finalize_model_grads
        self._loss_tokens = 1
        self._complete_grads = False

        def finalize(model, num_tokens=None, **kw):
            # DP sum (no averaging: per-token loss mode); an all-reduce when grads are inspected
            finalize_model_grads(model, num_tokens=None, **{**kw, "force_all_reduce": self._complete_grads})

        self.tconfig.finalize_model_grads_func = finalize
        self.tconfig.grad_scale_func = self.optimizer.scale_loss if self.cfg.model.dtype == "fp16" else None
        no_sync = [c.no_sync for c in self.model]
        self.tconfig.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync

    # --- steps ----------------------------------------------------------------------------------------

    def _forward_step(self, data_iterator, model):
        mb = device.to_device(next(data_iterator))
        return model(**self._model_inputs(mb)), partial(self._loss_func, mb)

    def _model_inputs(self, mb: dict) -> dict:
        """GPTModel's inputs for a micro-batch on the device. The ``TokenLayout`` of its optional
        ``position_ids`` / ``document_ids`` (packed documents) reaches every layer's attention as
        ``packed_seq_params``; without them, positions are 0..seq-1 and each row one document.
        Under context parallelism the token tensors are this CP rank's chunks and the layout the
        whole rows' (``context.ContextLayout``)."""
        ids = mb["input_ids"]
        kind = context.ContextLayout if self.cp_group is not None else TokenLayout
        layout = kind.of(ids, mb.get("position_ids"), mb.get("document_ids"))
        if self.cp_group is not None:
            layout.group = self.cp_group
        inputs = {"input_ids": ids, "position_ids": layout.position_ids, "attention_mask": None}
        if self.router_stats is not None and mb.get("document_ids") is not None:
            inputs["padding_mask"] = mb["document_ids"] == 0  # the routers leave the padded tail out
        if self.cp_group is not None:
            inputs = context.rank_slice(inputs, self.cp_group)
        if self.attention is not None:
            return inputs | {"packed_seq_params": layout}
        if "position_ids" in mb or "document_ids" in mb:
            raise ConfigError("megatron.attention=local applies neither per-token positions nor document "
                              "masks (packed documents); use megatron.attention=auto")
        return inputs

    def _rank_tokens(self, t: torch.Tensor) -> torch.Tensor:
        """``[b, s]`` -> this CP rank's tokens ``[b, s / cp]`` (itself without context parallelism)."""
        return t if self.cp_group is None else context.rank_slice({"t": t}, self.cp_group)["t"]

    def _loss_func(self, mb, logits):
        """The backward's start (loss sum / the global batch's count: the objective's), this micro-batch's
        count, and ``totals`` for the step's report: [loss sum, stats] (``toolkit/objectives/``)."""
        scores = VocabParallelScores(logits, self.hf_config.vocab_size, self.tp_rank)
        loss_sum, stats = self.objective(scores, mb | {"labels": self._rank_tokens(mb["labels"])})
        totals = torch.cat([loss_sum.detach().double().view(1), stats])
        return loss_sum / self._loss_tokens, stats[-1].int(), {"totals": totals}

    @property
    def _totals_size(self) -> int:
        return 1 + self.objective.stats_size

    def _run_schedule(self, micro_batches, forward_only: bool, beat=None) -> torch.Tensor:
        """Loss sum and token count over this rank's micro-batches (nonzero on the last stage only);
        ``beat()`` each time the schedule takes the next micro-batch."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        chunks = len(self.model)
        iters = [_beating(micro_batches, beat) if beat else iter(micro_batches) for _ in range(chunks)]
        mb = micro_batches[0]["input_ids"]
        out = get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=iters if chunks > 1 else iters[0],
            model=self.model, num_microbatches=len(micro_batches), seq_length=mb.shape[1],
            micro_batch_size=mb.shape[0], forward_only=forward_only)
        totals = device.zeros(self._totals_size, dtype=torch.float64)
        if self.is_last_stage and self.tp_rank == 0:  # TP ranks hold the same (reduced) losses
            for d in out:
                totals += d["totals"]
        return totals

    def forward_backward(self, micro_batches, loss_tokens: int, complete_grads: bool = False) -> torch.Tensor:
        """Gradients of sum(token losses) / loss_tokens in the DDP buffers (``param.main_grad``,
        reduce-scattered over DP: each rank's shard is complete; ``complete_grads``: all-reduced,
        so every rank holds the whole gradient, for inspection); returns this rank's [loss sum,
        token count]."""
        self._loss_tokens, self._complete_grads = loss_tokens, complete_grads
        self._set_aux_scale(len(micro_batches))
        for chunk in self.model:
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        return self._run_schedule(micro_batches, forward_only=False)

    def train_step(self, micro_batches, loss_tokens, lr):
        for group in self.optimizer.param_groups:
            group["lr"] = lr
            # megatron's groups carry wd_mult (0 for biases and norms); its own scheduler applies it,
            # and we replace that scheduler, so apply it here (as DeepSpeed's no-decay group does).
            group["weight_decay"] = self.cfg.train.weight_decay * group.get("wd_mult", 1.0)
        compute = device.Stopwatch()
        compute.start()
        totals = self.forward_backward(micro_batches, loss_tokens)
        compute.stop()  # includes pipeline waits: megatron interleaves them with compute
        # fp16: megatron's dynamic scaler skips the update on inf/nan gradients and lowers the scale
        # (from megatron.initial_loss_scale, with hysteresis 2)
        ok, grad_norm, _ = self.optimizer.step()
        dist.all_reduce(totals)  # sums over DP; only one rank per DP replica contributes
        extra = self.router_stats.metrics(len(micro_batches) * self.dp_size) if self.router_stats else {}
        values = totals.tolist()  # one host read: the loss and the objective's metrics
        extra.update(self.objective.metrics(values[1:]))
        scale = float(self.optimizer.get_loss_scale()) if self.cfg.model.dtype == "fp16" else None
        return StepStats(loss=values[0] / loss_tokens, grad_norm=float(grad_norm) if ok else None,
                         compute_s=compute.seconds(), skipped=not ok, loss_scale=scale, extra=extra)

    @property
    def dp_group(self):
        return grid.dp_group()

    def close(self) -> None:
        """Free this engine and megatron's process groups (17 per engine: 51 gloo threads on a CPU): DDP
        hooks each parameter's gradient accumulator with a closure over itself (a cycle through
        autograd's C++ nodes that Python's collector cannot see) and megatron's TransformerConfig holds
        the engine's callbacks, so an engine out of scope lived on, and ``destroy_model_parallel``
        forgets the groups without destroying them. The engine cannot step afterwards. Idempotent."""
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for chunk in self.model:
            chunk.grad_accs.clear()
        c = self.tconfig
        c.finalize_model_grads_func = c.no_sync_func = c.grad_scale_func = c.param_sync_func = None
        grid.destroy()

    def parameters(self):
        return (p for chunk in self.model for p in chunk.module.parameters())

    def replica_checksum(self) -> float:
        """Order-sensitive float64 checksum of this rank's parameters (equal across its DP group)."""
        total = torch.zeros((), dtype=torch.float64)
        for chunk in self.model:
            for i, p in enumerate(chunk.module.parameters()):
                total += (i + 1) * p.detach().double().sum().cpu()
        return total.item()

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches, beat=None):
        """Also sets ``eval_metrics`` (the objective's, over the eval rows)."""
        for chunk in self.model:
            chunk.eval()
        totals = (self._run_schedule(micro_batches, forward_only=True, beat=beat) if micro_batches
                  else device.zeros(self._totals_size, dtype=torch.float64))
        for chunk in self.model:
            chunk.train()
        dist.all_reduce(totals)
        values = totals.tolist()  # one host read
        self.eval_metrics = self.objective.metrics(values[1:], prefix="eval_")
        return values[0], int(values[-1])

    @torch.no_grad()
    def document_logps(self, micro_batches, width: int, beat=None) -> list[torch.Tensor] | None:
        """``[mbs, width]`` fp64 log-probability sums of each document's answer per micro-batch, from
        the model as it is (built, before any step: the starting model; a LoRA run's adapters start at
        B = 0, adding exactly nothing), on the last stage's TP rank 0 of every DP replica; None elsewhere."""
        vocab = self.hf_config.vocab_size

        def step(data_iterator, model):
            mb = device.to_device(next(data_iterator))

            def loss_func(output):
                logps = VocabParallelScores(output, vocab, self.tp_rank).logps(mb["labels"])
                sums = document_sums(logps, mb["document_ids"], width)
                return output.sum() * 0, device.tensor(1, dtype=torch.int), {"sums": sums}
            return model(**self._model_inputs(mb)), loss_func

        out = self._forward_only(step, micro_batches, beat)
        return [d["sums"] for d in out] if self.is_last_stage and self.tp_rank == 0 else None

    def _forward_only(self, step, micro_batches, beat=None) -> list[dict]:
        """megatron's schedule of ``step`` over ``micro_batches``, forward only, in eval mode; the loss
        functions' outputs (on the last stage). ``beat()`` as each micro-batch is taken."""
        from megatron.core.pipeline_parallel import get_forward_backward_func
        for chunk in self.model:
            chunk.eval()
        iters = [_beating(micro_batches, beat) if beat else iter(micro_batches) for _ in self.model]
        ids = micro_batches[0]["input_ids"]
        out = get_forward_backward_func()(
            forward_step_func=step, data_iterator=iters if len(iters) > 1 else iters[0], model=self.model,
            num_microbatches=len(micro_batches), seq_length=ids.shape[1], micro_batch_size=ids.shape[0],
            forward_only=True)
        for chunk in self.model:
            chunk.train()
        return out

    @torch.no_grad()
    def logits(self, micro_batches) -> list[torch.Tensor] | None:
        """Full-vocabulary logits ``[mbs, seq, vocab]`` (padding dropped) per micro-batch, on the last
        pipeline stage's TP rank 0 (CP rank 0) of every DP replica (each for its own micro-batches); None on
        other ranks. For parity checks."""
        from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
        vocab = self.hf_config.vocab_size

        def loss_func(output):
            full = gather_from_tensor_model_parallel_region(output)[..., :vocab].float().clone()
            if self.cp_group is not None:  # [b, s / cp, vocab] -> the whole rows in token order
                full = context.gather_rows(full, self.cp_group, dim=1)
            return output.sum() * 0, device.tensor(1, dtype=torch.int), {"logits": full}

        def step(data_iterator, model):
            return model(**self._model_inputs(device.to_device(next(data_iterator)))), loss_func

        out = self._forward_only(step, micro_batches)
        mine = self.is_last_stage and self.tp_rank == 0 and self.cp_rank == 0
        return [d["logits"] for d in out] if mine else None

    # --- checkpoints and export (toolkit/adapters/megatron/state.py, export.py) ----------------------

    def save(self, path: Path, step: int = 0, beat=None) -> None:
        """megatron's dist_checkpointing writes every file in one call: ``beat()`` after it."""
        state.save(self, path)
        if beat:
            beat()

    def load(self, path: Path) -> None:
        state.load(self, path)

    def describe(self) -> dict:
        return state.describe(self)

    def hf_state(self, attr: str | None = None) -> dict[str, torch.Tensor] | None:
        """The current weights (or ``attr`` of them, e.g. ``main_grad``) as an HF state dict on rank 0."""
        return export.hf_state(self, attr)

    def adapter_state(self, attr: str | None = None) -> dict[str, torch.Tensor] | None:
        """A LoRA run's adapters (or ``attr`` of them, e.g. ``main_grad``) in HF-PEFT names on rank 0."""
        return lora.gather_adapters(self, attr)

    def export_hf(self, path: Path, tokenizer, beat=None) -> None:
        export.export_hf(self, path, tokenizer, beat)

    def can_load_layout(self, saved: dict) -> bool:
        """torch_dist with a fully reshardable optimizer: megatron reshards any TP/PP/DP on load."""
        return saved.get("format") == "torch_dist"

    def rng_state(self) -> dict:
        """The model-parallel RNG tracker's streams (dropout inside TP regions, expert-parallel init)."""
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        return {"mcore_rng_tracker": get_cuda_rng_tracker().get_states()}

    def set_rng_state(self, state: dict) -> None:
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        if "mcore_rng_tracker" in state:
            get_cuda_rng_tracker().set_states(state["mcore_rng_tracker"])

    def layout_record(self) -> dict:
        return self.lay.record()

    def attention_kernels(self) -> str:
        """Which attention kernel runs for this run's device and precision (logged once per run)."""
        line = describe_kernels(self.cfg.megatron.attention, device.rank_device().type, self.cfg.model.dtype,
                                rope=self.family.position_embedding == "rope",
                                softcap=bool(self.attention and self.attention.softcap),
                                dropout=self.tconfig.attention_dropout > 0)
        if self.lay.cp > 1:
            line += (f"; megatron.cp={self.lay.cp}: each rank holds 2 of the {2 * self.lay.cp} chunks of every row, "
                     "heads exchanged for the whole rows by an all-to-all")
        return line


def check_machine(plan: Plan) -> None:
    """What this machine must offer the plan (a plan is made and estimated anywhere; the launcher
    and the engine ask here, where the answer is known)."""
    if plan.model.experts and plan.config.megatron.moe_dispatcher == "alltoall" and not torch.cuda.is_available():
        raise ConfigError("megatron.moe_dispatcher=alltoall needs GPUs (its all_to_all fails on CPU/gloo); "
                          "use megatron.moe_dispatcher=allgather")
    if plan.config.megatron.attention == "flex" and not torch.cuda.is_available():
        raise ConfigError("megatron.attention=flex needs a GPU to train (torch's flex_attention has no CPU "
                          "backward); use megatron.attention=auto (sdpa on CPU) or sdpa")


def vocab_parallel_loss_sum(logits: torch.Tensor, labels: torch.Tensor, vocab: int, tp_rank: int):
    """Sum of token cross-entropies over the true vocabulary and the valid-token count.

    logits: TP rank ``tp_rank``'s ``[batch, seq, padded_vocab / tp]``; labels ``[batch, seq]`` with
    IGNORE_INDEX where no loss is taken. Columns at or beyond ``vocab`` are set to -inf."""
    losses, valid = vocab_parallel_token_losses(logits, labels, vocab, tp_rank)
    return losses.sum(), valid.sum()


def vocab_parallel_token_losses(logits: torch.Tensor, labels: torch.Tensor, vocab: int, tp_rank: int):
    """``vocab_parallel_loss_sum`` per token: ``[batch, seq]`` cross-entropies (0 where no loss) and the
    valid mask (``VocabParallelScores.logps``: negated, the log-probabilities)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy
    width = logits.shape[-1]
    start = tp_rank * width
    logits = logits.float()
    if start + width > vocab:
        pad = torch.arange(start, start + width, device=logits.device) >= vocab
        logits = logits.masked_fill(pad, float("-inf"))
    device.require_on_device(labels, "labels")
    valid = labels != IGNORE_INDEX
    losses = vocab_parallel_cross_entropy(logits.contiguous(), labels.masked_fill(~valid, 0))
    return losses * valid, valid


class VocabParallelScores:
    """TP rank ``tp_rank``'s vocabulary-parallel logits ``[batch, seq, padded_vocab / tp]`` as the objectives
    read them (``objectives.base.Scores``)."""

    def __init__(self, logits: torch.Tensor, vocab: int, tp_rank: int):
        self.logits, self.vocab, self.tp_rank = logits, vocab, tp_rank

    def loss_sum(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return vocab_parallel_loss_sum(self.logits, labels, self.vocab, self.tp_rank)

    def logps(self, labels: torch.Tensor) -> torch.Tensor:
        losses, _ = vocab_parallel_token_losses(self.logits, labels, self.vocab, self.tp_rank)
        return -losses


def build_engine(plan: Plan, run_dir: Path, rank: int) -> MegatronEngine:
    """The worker's entry: record the layout, build the engine from the run's HF model."""
    if rank == 0:
        (Path(run_dir) / "megatron_layout.json").write_text(plan.layout(dist.get_world_size()).model_dump_json(indent=2))
    engine = MegatronEngine(plan)
    if rank == 0:
        print(engine.attention_kernels(), flush=True)
    return engine


def _beating(micro_batches, beat):
    """The micro-batches, ``beat()`` before each after the first (the previous one's work is done)."""
    for i, mb in enumerate(micro_batches):
        if i:
            beat()
        yield mb

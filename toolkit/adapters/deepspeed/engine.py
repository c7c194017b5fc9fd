"""DeepSpeed ZeRO adapter: the Engine protocol over ``deepspeed.initialize`` with the DeepSpeed JSON
the plan resolved (``toolkit/plan/presets.py``); data parallel over the whole world, or dp x sp with
Ulysses sequence parallelism (``zero.sp``: ``adapters/deepspeed/ulysses.py``)."""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from toolkit import device
from toolkit.adapters import hf_attention, moe, vlm
from toolkit.adapters.deepspeed.lora import saved_layout, to_universal
from toolkit.adapters.deepspeed.moe import (
    RouterLoss,
    autoep_source,
    check_autoep_replaced,
    differs_across_ep_group,
    experts_as_leaf_modules,
    prepare_autoep,
)
from toolkit.adapters.deepspeed.optimizer import OptimizerChoice, replay_cpu_adam_step_counter, with_available_adam
from toolkit.adapters.deepspeed.tiles import HiddenStates, tile_mlps
from toolkit.adapters.deepspeed.ulysses import (
    SequenceSplit,
    average_zero3_grads_over_dp,
    forget_sequence_groups,
    same_zero_files,
    use_ulysses_attention,
)
from toolkit.adapters.deepspeed.zero3 import fill_partitions, hf_zero3_load, zero_init
from toolkit.adapters.hf import experts_implementation, model_dir, param_groups
from toolkit.config import ConfigError
from toolkit.engine import DTYPES, StepStats
from toolkit.loss import LogitScores, tiled_token_loss_sum
from toolkit.objectives import document_sums
from toolkit.plan import Plan


def _install_op_caches() -> None:
    from toolkit.compat import cpuinfo_cache, torch_extensions
    cpuinfo_cache.install()  # DeepSpeed's CPU op builders would start a subprocess per query
    torch_extensions.install()  # this environment's own JIT-built ops (no rebuilds across venvs)


def prebuilt_ops() -> list[str]:
    """DeepSpeed ops compiled at install time (the rest are JIT-compiled at first use)."""
    from deepspeed.git_version_info import installed_ops
    return sorted(op for op, ok in installed_ops.items() if ok)


def check_dtype_supported(dtype: str) -> None:
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()
    if dtype == "fp16" and not acc.is_fp16_supported():
        raise ConfigError(f"model.dtype=fp16 is not supported by DeepSpeed's {acc.device_name()} accelerator; "
                          "use model.dtype=bf16 or fp32")
    if dtype == "bf16" and not acc.is_bf16_supported():
        raise ConfigError(f"model.dtype=bf16 is not supported by DeepSpeed's {acc.device_name()} accelerator; "
                          "use model.dtype=fp32")


# --- engine --------------------------------------------------------------------------------------

class DeepSpeedEngine:
    """The Engine protocol over ``deepspeed.initialize``; data parallel over the whole world, or over
    dp = world / sp replicas whose sp ranks split each row's tokens (``zero.sp``)."""

    def __init__(self, plan: Plan, model: torch.nn.Module, resolved: tuple[dict, OptimizerChoice] | None = None):
        """``resolved``: ``with_available_adam`` of the plan's DeepSpeed JSON, when already made."""
        import deepspeed
        _install_op_caches()
        cfg = plan.config
        check_dtype_supported(cfg.model.dtype)
        self.cfg, self.lay = cfg, plan.layout(dist.get_world_size())
        self.ds_config, self.optimizer_choice = resolved or with_available_adam(plan.ds_config(dist.get_world_size()))
        self.setup_records = [self.optimizer_choice.record()]  # for metrics.jsonl (the trainer logs them)
        self.lora = plan.lora
        self.objective, self.eval_metrics = plan.objective, {}
        self.seq = SequenceSplit(self.lay, model.config) if self.lay.sp > 1 else None
        if self.seq is None:
            forget_sequence_groups()
        self.router = RouterLoss(cfg, model, self.seq.mpu.get_sequence_parallel_group() if self.seq else None) \
            if moe.is_router_model(model.config) else None
        if self.router and self.lay.ep == 1:  # which experts implementation runs (model.experts_implementation;
            # auto: transformers'); under zero.ep AutoEP's replace them (the moe record below says how)
            self.setup_records.append({"event": "experts", "experts_implementation": experts_implementation(model),
                                       "requested": cfg.model.experts_implementation})
        if self.lay.ep > 1:
            prepare_autoep()  # AutoEP replaces the MoE blocks in deepspeed.initialize
        elif self.router and cfg.zero.stage == 3:
            experts_as_leaf_modules(model)
        if cfg.zero.tiled_mlp:
            tile_mlps(model)
        self.hidden = HiddenStates(model) if cfg.zero.tiled_loss else None  # the token cross-entropy only (config)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=_named_groups(param_groups(model, cfg.train.weight_decay), self.lay.ep),
            config=self.ds_config,
            mpu=self.seq.mpu if self.seq else None)
        if self.lay.ep > 1:
            self.setup_records.append(check_autoep_replaced(self.engine.module, plan.model.moe_layers, self.lay.ep,
                                                            self.ds_config["expert_parallel"]["use_grouped_mm"]))
        _undo_state_init_step(self.engine.optimizer)
        if self.seq and cfg.zero.stage == 3:
            average_zero3_grads_over_dp(self.engine.optimizer, self.seq.sp)
        self.dp_rank, self.dp_size = (self.seq.dp_rank, self.seq.dp_size) if self.seq else \
            (dist.get_rank(), dist.get_world_size())
        self.dp_group = self.seq.dp_group if self.seq else None
        device.guard_inputs(self.engine.module, "the HF model")

    def train_step(self, micro_batches, loss_tokens, lr):
        self._set_lr(lr)
        # DeepSpeed averages gradients over DP ranks; scaling by dp makes the sum over ranks of
        # local sums / loss_tokens, i.e. the mean over the whole global batch (the loss contract;
        # loss_tokens is the objective's count: tokens, or pairs; toolkit/objectives/). With zero.sp each
        # rank's sum is over its slice of the rows, and DeepSpeed sums gradients over the world and
        # divides by dp = world / sp: the same mean.
        scale = self.dp_size / loss_tokens
        local_sum = 0
        grad_norm, forward_time, skipped_before = None, device.Stopwatch(), self.engine.skipped_steps
        for i, mb in enumerate(micro_batches):
            mb = device.to_device(mb)
            forward_time.start()
            out = self._forward(mb)
            forward_time.stop()
            loss_sum, stats = self._loss_sum(out, mb)
            objective = loss_sum * scale
            if self.router:  # DeepSpeed averages over DP: / micro-batches makes it the global mean
                objective = objective + self.router.loss(out.router_logits, self._real_tokens(mb)) / len(micro_batches)
            self.engine.backward(objective, scale_wrt_gas=False)
            del out, objective  # else this micro-batch's logits [b, s, V] live through the next forward
            if i == len(micro_batches) - 1 and self._norm_not_recorded:
                grad_norm = self._reduced_grad_norm()
            self.engine.step()
            local_sum = local_sum + torch.cat([loss_sum.detach().double().view(1), stats])
        dist.all_reduce(local_sum)
        skipped = self.engine.skipped_steps > skipped_before  # fp16 overflow: DeepSpeed skipped the update
        if grad_norm is None:
            grad_norm = float(self.engine.get_global_grad_norm())
        extra = self.router.stats.metrics(len(micro_batches) * self.dp_size) if self.router and self.router.stats else {}
        totals = local_sum.tolist()  # one host read: the loss and the objective's metrics
        extra.update(self.objective.metrics(totals[1:]))
        return StepStats(loss=totals[0] / loss_tokens, grad_norm=None if skipped else grad_norm,
                         compute_s=forward_time.seconds(), skipped=skipped, loss_scale=self._loss_scale(),
                         extra=extra)

    def close(self) -> None:
        """DeepSpeed's own ``destroy`` (its optimizer's hooks and buffers); the engine cannot step afterwards."""
        self.engine.destroy()

    def _loss_scale(self) -> float | None:
        """fp16's dynamic loss scale (DeepSpeed's fp16 and ZeRO optimizers keep it in different places)."""
        if self.cfg.model.dtype != "fp16":
            return None
        opt = self.engine.optimizer
        for holder in (opt, getattr(opt, "loss_scale_config", None), getattr(opt, "loss_scaler", None)):
            scale = getattr(holder, "cur_scale", None)
            if scale is not None:
                return float(scale)
        return None

    def _forward(self, mb: dict, router: bool = True):
        """The HF forward of a micro-batch; rows packed by documents bring their positions and
        layout (``adapters/hf_attention.py``), and a forward that ignored them raises. With zero.sp,
        this rank's slice of the rows (``ulysses.SequenceSplit.inputs``): logits of its tokens."""
        inputs = self.seq.inputs(mb) if self.seq else vlm.forward_inputs(mb, self.engine.module) \
            if "pixel_values" in mb else hf_attention.forward_inputs(mb)
        if self.hidden:  # zero.tiled_loss: the loss runs the lm_head per tile on the hidden states
            inputs["logits_to_keep"] = 1
        out = self.engine(**inputs, output_router_logits=True) if self.router and router else self.engine(**inputs)
        hf_attention.check_applied(inputs)
        return out

    def _loss_sum(self, out, mb: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """The objective's (loss sum, stats) of this rank's tokens; with zero.tiled_loss, from the decoder's
        hidden states and the lm_head a tile at a time (``_TiledScores``), never the whole logits."""
        scores = _TiledScores(self.hidden) if self.hidden else LogitScores(out.logits)
        return self.objective(scores, mb | {"labels": self._labels(mb)})

    def _labels(self, mb: dict) -> torch.Tensor:
        """The labels of the tokens this rank's forward scored."""
        return self.seq.local(mb["labels"]) if self.seq else mb["labels"]

    def _real_tokens(self, mb: dict) -> torch.Tensor | None:
        """``hf_attention.real_tokens`` of the tokens this rank's forward routed (its slice under zero.sp)."""
        if self.seq is None or mb.get("document_ids") is None:
            return hf_attention.real_tokens(mb)
        return hf_attention.real_tokens({"document_ids": self.seq.local(mb["document_ids"])})

    @property
    def _norm_not_recorded(self) -> bool:
        """Only fp32 without ZeRO leaves DeepSpeed's optimizer unwrapped, recording no grad norm;
        its module grads are then unscaled (fp16's loss scale lives in its optimizer wrapper)."""
        return self.cfg.zero.stage == 0 and self.cfg.model.dtype == "fp32"

    def _reduced_grad_norm(self) -> float:
        """The global norm from the module's grads (all-reduced by now); under zero.ep each rank holds its
        own experts' grads, whose squares are summed over the EP group."""
        params = [p for p in self.engine.module.parameters() if p.grad is not None]
        squares = [torch.linalg.vector_norm(p.grad.float()) ** 2 for p in params if not differs_across_ep_group(p)]
        experts = [p for p in params if differs_across_ep_group(p)]
        if experts:
            from deepspeed.utils.groups import _get_expert_parallel_group
            local = torch.stack([torch.linalg.vector_norm(p.grad.float()) ** 2 for p in experts]).sum()
            dist.all_reduce(local, group=_get_expert_parallel_group(experts[0].group_name))
            squares.append(local)
        return torch.stack(squares).sum().sqrt().item()

    def _set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches, beat=None):
        """Also sets ``eval_metrics`` (the objective's, over the eval rows)."""
        self.engine.eval()
        totals = device.zeros(1 + self.objective.stats_size, dtype=torch.float64)
        for mb in map(device.to_device, micro_batches):
            out = self._forward(mb, router=False)
            loss_sum, stats = self._loss_sum(out, mb)
            del out  # its logits are not alive while the next micro-batch's are computed
            totals += torch.cat([loss_sum.double().view(1), stats])
            if beat:
                beat()
        self.engine.train()
        dist.all_reduce(totals)
        values = totals.tolist()  # one host read
        self.eval_metrics = self.objective.metrics(values[1:], prefix="eval_")
        return values[0], int(values[-1])

    @torch.no_grad()
    def document_logps(self, micro_batches, width: int, beat=None) -> list[torch.Tensor] | None:
        """``[mbs, width]`` fp64 log-probability sums of each document's answer per micro-batch, from
        the model as it is (a LoRA run's base: adapters off); every rank for its own micro-batches."""
        self.engine.eval()
        with self.engine.module.disable_adapter() if self.lora else contextlib.nullcontext():
            out = []
            for mb in map(device.to_device, micro_batches):
                logps = LogitScores(self._forward(mb, router=False).logits).logps(mb["labels"])
                out.append(document_sums(logps, mb["document_ids"], width))
                if beat:
                    beat()
        self.engine.train()
        return out

    def save(self, path: Path, step: int, beat=None) -> None:
        """A LoRA run saves only what it trains (adapters, modules to save, their optimizer state): the
        frozen base is the model it started from, identified in meta.json (``storage/meta.py``).
        ``beat()`` after each file DeepSpeed's checkpoint engine writes."""
        with _beating_per_file(self.engine.checkpoint_engine, beat):
            self.engine.save_checkpoint(str(path), tag=f"global_step{step}", client_state={},
                                        exclude_frozen_parameters=self.lora is not None)

    def load(self, path: Path) -> None:
        path, resharded = Path(path), None
        universal = (path / "latest_universal").is_file()  # toolkit convert --to zero: loads at any layout
        saved = saved_layout(path)
        if self.lora and not universal and saved is not None and not same_zero_files(saved, self.layout_record()):
            path = resharded = self._lora_universal(path)
        load_path, _ = self._load_checkpoint(path)
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint to load under {path}")
        replay_cpu_adam_step_counter(self.engine.basic_optimizer)
        if resharded is not None:
            dist.barrier()  # every rank has read it
            if dist.get_rank() == 0:
                shutil.rmtree(resharded.parent, ignore_errors=True)

    def _lora_universal(self, engine_dir: Path) -> Path:
        """An adapter-only checkpoint written at another DP size or stage, in DeepSpeed's universal
        layout (``ds_to_universal``: one folder per trained parameter, fp32 and Adam moments), which
        DeepSpeed loads at any layout. Rank 0 converts (the adapters are small); collective."""
        out = Path(self.cfg.run_dir) / "resharded" / f"{engine_dir.parent.name}-lora-universal" / "engine"
        error = [None]
        if dist.get_rank() == 0:
            try:
                to_universal(engine_dir, out)
            except Exception as exc:  # every rank raises it, none waits on a barrier alone
                error = [f"converting the LoRA checkpoint {engine_dir.parent} to DeepSpeed's universal layout "
                         f"failed: {exc!r}"]
        dist.broadcast_object_list(error, src=0)
        if error[0]:
            raise RuntimeError(error[0])
        return out

    def _load_checkpoint(self, path: Path):
        """DeepSpeed's load_checkpoint; a universal checkpoint (``toolkit convert --to zero`` writes
        one: ``latest_universal``, per-parameter files) loads at any DP size and stage, but DeepSpeed
        reads the layout from its config flag, so the flag is set for this load only."""
        config = self.engine._config
        saved = config.load_universal_checkpoint
        config.load_universal_checkpoint = saved or (path / "latest_universal").is_file()
        try:
            return self.engine.load_checkpoint(str(path), load_optimizer_states=True,
                                               load_lr_scheduler_states=False, load_module_strict=True,
                                               custom_load_fn=_load_trained_only if self.lora else None)
        finally:
            config.load_universal_checkpoint = saved

    def export_hf(self, path: Path, tokenizer, beat=None) -> None:
        """Collective: ``path`` in fp32, written tensor by tensor (under ZeRO-3 each parameter is
        gathered alone, so no rank holds more than one beyond its partition). A LoRA run writes the
        merged model there, and its adapter as an HF-PEFT directory beside it (``adapter/``), both
        from the optimizer's fp32 masters (``trained_fp32``), merged onto the base as stored."""
        from toolkit.adapters.export import ModuleSource, trained_fp32, write_adapter, write_merged, write_streamed
        module, gather = self.engine.module, _gathered if self.lay.zero_stage == 3 else None
        generation_config = getattr(module, "generation_config", None)
        if not self.lora:
            source = autoep_source(module, gather) if self.lay.ep > 1 else \
                ModuleSource(module, module.config.model_type, gather=gather)
            write_streamed(source, path, tokenizer, generation_config, beat=beat)
            return
        trained = trained_fp32(module, gather)
        pretrained = self.cfg.model.init == "pretrained"
        # a 4-bit base is merged as it trained (dequantized from the module), not re-read from its files
        # and a vision-language base too: its files hold transformers' legacy names (docs/vlm.md), the module its own
        from_files = pretrained and self.cfg.model.quantize == "none" and not vlm.is_vlm(module)
        base = model_dir(self.cfg.model.name_or_path) if from_files else None
        write_merged(module, trained, path, tokenizer, generation_config, gather, base, beat=beat)
        write_adapter(module, Path(path).parent / "adapter", trained, base_name=self.cfg.model.name_or_path
                      if pretrained else None, quantization=self.cfg)

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def parameters(self):
        return self.engine.module.parameters()

    def replica_checksum(self) -> float | None:
        """Order-sensitive float64 checksum of the full parameters (identical on every DP replica
        below ZeRO-3); None at stage 3, where each rank holds only its own shard. Under zero.ep the
        experts (other experts on each rank of an EP group) are left out: the rest is replicated."""
        if self.cfg.zero.stage == 3:
            return None
        from toolkit.lora.quant import checksum_view
        total = torch.zeros((), dtype=torch.float64)
        for i, p in enumerate(self.engine.module.parameters()):
            if differs_across_ep_group(p):
                continue
            total += (i + 1) * checksum_view(p).double().sum().cpu()  # 4-bit storage: as integers (NaN patterns)
        return total.item()

    def rng_state(self) -> dict:
        return {}  # DeepSpeed draws from torch's default generators only (checkpointed by the trainer)

    def set_rng_state(self, state: dict) -> None:
        pass

    def can_load_layout(self, saved: dict) -> bool:
        """DeepSpeed loads its own layout only; another DP size or stage is converted first (a LoRA
        checkpoint by ``load`` itself, through DeepSpeed's universal layout: ``_lora_universal``).
        zero.sp does not change what is saved: ZeRO partitions over dp x sp ranks alike, so a
        checkpoint of as many partitions at the same stage loads as it is (sp=2 dp=1 as sp=1 dp=2)."""
        return same_zero_files(saved, self.layout_record()) or (self.lora is not None and saved.get("tp", 1) == 1)

    def layout_record(self) -> dict:
        return self.lay.record()


class _TiledScores:
    """zero.tiled_loss's ``Scores``: the token cross-entropy from the decoder's hidden states and the lm_head,
    a tile at a time (``loss.tiled_token_loss_sum``); no whole per-token log-probabilities (config refuses
    the objectives that need them)."""

    def __init__(self, hidden: HiddenStates):
        self.hidden = hidden

    def loss_sum(self, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tiled_token_loss_sum(self.hidden.take(), self.hidden.head, labels, tied=self.hidden.tied)

    def logps(self, labels: torch.Tensor) -> torch.Tensor:
        raise ConfigError("zero.tiled_loss=true gives the token cross-entropy only; set zero.tiled_loss=false")


def _named_groups(groups: list[dict], ep: int) -> list[dict]:
    """Under zero.ep DeepSpeed splits each parameter group into its dense and expert parts by the group's
    ``name`` (``moe.utils.split_params_into_different_moe_groups_for_optimizer``), after pointing the
    groups at AutoEP's replacement parameters; without ep the groups stay as they were (their
    checkpoints unchanged)."""
    if ep == 1:
        return groups
    return [{**g, "name": f"toolkit_group{i}"} for i, g in enumerate(groups)]


def _undo_state_init_step(optimizer) -> None:
    """DeepSpeed's FP16_Optimizer (ZeRO stage 0 in bf16 or fp16) creates Adam's state by stepping
    once on zero gradients: Adam's step count starts at 1, so every later bias correction is one
    step behind (the first update 0.74x with beta2=0.95), and that step applied one weight decay
    to the fp32 masters. Measured: bf16 ZeRO-0 drifted 1.8e-3 from fp32 in 3 steps, ZeRO-1 5e-5.
    Fresh state and masters copied again from the model weights make the first update step 1."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    if not isinstance(optimizer, FP16_Optimizer):
        return
    from torch._utils import _flatten_dense_tensors
    optimizer.optimizer.state.clear()
    for group in optimizer.optimizer.param_groups:
        group.pop("step", None)  # FusedAdam seeds a new state's step from its group's
    with torch.no_grad():
        for master, weights in zip(optimizer.fp32_groups_flat, optimizer.fp16_groups):
            master.copy_(_flatten_dense_tensors([w.detach() for w in weights]).float())


def build_engine(plan: Plan, run_dir: Path, rank: int) -> DeepSpeedEngine:
    """The worker's entry: record the resolved DeepSpeed JSON, build the HF model and the engine."""
    _install_op_caches()
    ds_config, choice = resolved = with_available_adam(plan.ds_config(dist.get_world_size()))
    if rank == 0:
        print(choice.line(), flush=True)
        (Path(run_dir) / "ds_config.json").write_text(json.dumps(ds_config, indent=2))
        if plan.config.data.packing_mode != "concat":
            hf_config = plan.model.hf_config()
            print(hf_attention.describe(device.rank_device().type, dropout=_attention_dropout(hf_config),
                                        softcap=bool(getattr(hf_config, "attn_logit_softcapping", None))), flush=True)
    check_dtype_supported(plan.config.model.dtype)  # before reading any weight
    engine = DeepSpeedEngine(plan, build_model(plan, ds_config), resolved)
    if vlm.is_vlm(plan.model.hf_config()) and rank == 0:
        print(vlm.describe_freeze(engine.module, plan.config.model.freeze_vision), flush=True)
    if engine.seq and rank == 0:
        print(engine.seq.describe(), flush=True)
    return engine


def _attention_dropout(hf_config) -> bool:
    return bool(getattr(hf_config, "attention_dropout", 0.0) or getattr(hf_config, "attn_pdrop", 0.0))


@contextlib.contextmanager
def _beating_per_file(checkpoint_engine, beat):
    """``beat()`` after each file DeepSpeed's checkpoint engine writes (its ``save(state, path)``)."""
    if beat is None:
        yield
        return
    save = checkpoint_engine.save

    def save_and_beat(*args, **kwargs):
        result = save(*args, **kwargs)
        beat()
        return result
    checkpoint_engine.save = save_and_beat
    try:
        yield
    finally:
        del checkpoint_engine.save  # the class's method again


@contextlib.contextmanager
def _gathered(*params):
    """ZeRO-3 parameters (one, or a LoRA layer's base weight and adapters) whole on every rank (read only)."""
    import deepspeed
    with deepspeed.zero.GatheredParameters(list(params), modifier_rank=None):
        yield


@contextlib.contextmanager
def _written_by_rank0(param):
    """One ZeRO-3 parameter whole on every rank; rank 0's values are kept (it writes them)."""
    import deepspeed
    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        yield dist.get_rank() == 0


def build_model(plan: Plan, ds_config: dict) -> torch.nn.Module:
    """The HF model for this rank (``_build_hf``), wrapped by peft for a LoRA run (``lora/peft.py``:
    the adapters are created whole on every rank, alike, and ``deepspeed.initialize`` partitions them
    at ZeRO-3)."""
    model = _build_hf(plan, ds_config)
    if plan.lora is None:
        return model
    from toolkit.lora.peft import apply_lora
    return apply_lora(model, plan.lora, plan.config.train.seed)


def _load_trained_only(src: dict, dst: torch.nn.Module) -> None:
    """DeepSpeed's module load for a LoRA checkpoint: it holds the trained parameters (and buffers)
    only; exactly those must be there, and the frozen base stays as it was built."""
    frozen = {n for n, p in dst.named_parameters() if not p.requires_grad}
    expected = set(dst.state_dict()) - frozen
    missing, unexpected = sorted(expected - set(src)), sorted(set(src) - expected)
    if missing or unexpected:
        raise RuntimeError(f"LoRA checkpoint does not hold this run's trained parameters: missing {missing[:8]}, "
                           f"unexpected {unexpected[:8]} (is it from a run with the same lora.* settings?)")
    dst.load_state_dict(src, strict=False)


def _build_hf(plan: Plan, ds_config: dict) -> torch.nn.Module:
    """The HF model for this rank: at ZeRO-3 built under DeepSpeed's ``zero.Init``, so each parameter
    is partitioned as it is created and filled partition by partition (the seeded init drawn piece
    by piece on rank 0 and scattered one parameter at a time, or this rank's element ranges of the
    checkpoint); below stage 3 the one full copy ZeRO 0-2 keep, in the training dtype, on the rank's
    device (``adapters/hf.py``). A pretrained model of a family the toolkit has no table for loads
    through transformers (under ``zero.Init`` at ZeRO-3, as HF Trainer does)."""
    from toolkit.adapters import hf
    dtype = DTYPES[plan.config.model.dtype]
    if plan.config.model.quantize != "none":  # a 4-bit base, piece by piece (partitioned so at ZeRO-3)
        from toolkit.adapters.deepspeed.quant import build_quantized
        return build_quantized(plan, ds_config, dtype, device.rank_device(), _sequence_attention(plan))
    if plan.layout(dist.get_world_size()).zero_stage < 3:
        return hf.build_model(plan, dtype, device.rank_device(), _sequence_attention(plan))
    import deepspeed
    from transformers.initialization import no_init_weights

    from toolkit.families.meta import auto_class
    from toolkit.parallel import comm_backend
    deepspeed.init_distributed(dist_backend=comm_backend())  # over our process group: zero.Init reads the world
    if plan.config.model.init == "pretrained" and not hf.reads_by_slice(plan):
        return hf.finish(hf_zero3_load(plan, ds_config, dtype), plan, _sequence_attention(plan))
    with zero_init(ds_config, dtype), no_init_weights():
        hf_config = plan.model.hf_config()
        model = auto_class(hf_config).from_config(hf_config, dtype=dtype,  # partitions: filled below
                                                  trust_remote_code=plan.config.model.trust_remote_code)
    model.tie_weights()
    if plan.config.model.init == "pretrained":
        fill_partitions(model, hf.hf_checkpoint(plan), plan)
    else:
        hf.seeded_into(model, hf.SeededWeights(model.config, plan.config.train.seed), gather=_written_by_rank0)
    return hf.finish(model, plan, _sequence_attention(plan))


def _sequence_attention(plan: Plan):
    """What ``hf.finish`` installs for this run's sequence split: Ulysses' attention under ``zero.sp``
    (the toolkit's document attention inside DeepSpeed's exchange), else None (hf's own choice)."""
    return use_ulysses_attention if plan.config.zero.sp > 1 else None

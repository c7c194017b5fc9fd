"""DeepSpeed ZeRO adapter: DeepSpeed JSON with "auto" resolved from the run config, and an Engine.

Only this module (and convert/) imports deepspeed.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from toolkit import device, moe
from toolkit.adapters.hf import param_groups
from toolkit.config import ConfigError, RunConfig
from toolkit.engine import StepStats, token_loss_sum

DS_CONFIG_DIR = Path(__file__).resolve().parents[2] / "ds_configs"
AUTO = "auto"


# --- config resolution ---------------------------------------------------------------------------

def read_ds_config(cfg: RunConfig) -> tuple[dict, str]:
    """The user's DeepSpeed JSON (a path or a ds_configs/ name) and where it came from."""
    name = cfg.zero.ds_config or f"zero{cfg.zero.stage}"
    path = Path(name)
    if not path.is_file():
        path = DS_CONFIG_DIR / (name if name.endswith(".json") else f"{name}.json")
    if not path.is_file():
        known = sorted(p.stem for p in DS_CONFIG_DIR.glob("*.json"))
        raise ConfigError(f"zero.ds_config={name!r} is neither a file nor one of ds_configs/ {known}")
    try:
        return json.loads(path.read_text()), str(path)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"zero.ds_config {path}: not valid JSON ({exc})") from None


def resolve_ds_config(cfg: RunConfig, world_size: int, hidden_size: int) -> dict:
    """Fill every "auto" from the run config; a concrete value that contradicts it is an error.

    Run-config fields the user did not set explicitly adopt the JSON's concrete values instead (so
    ``--set zero.ds_config=zero3`` alone means stage 3). ``cfg`` is updated to match.
    """
    ds, source = read_ds_config(cfg)
    if "scheduler" in ds:
        raise ConfigError(f"{source} has a 'scheduler' section, but the toolkit owns the LR schedule for every "
                          "backend; remove it and set train.lr_schedule / train.warmup_steps instead")
    _adopt_explicit_json_values(cfg, ds, source)
    zero = ds.setdefault("zero_optimization", {})
    t = cfg.train
    dp = world_size
    wanted: dict[tuple[str, ...], Any] = {
        ("train_batch_size",): t.global_batch_size,
        ("train_micro_batch_size_per_gpu",): t.micro_batch_size,
        ("gradient_accumulation_steps",): t.global_batch_size // (t.micro_batch_size * dp),
        ("gradient_clipping",): t.grad_clip,
        ("bf16", "enabled"): cfg.model.dtype == "bf16",
        ("fp16", "enabled"): cfg.model.dtype == "fp16",
        ("zero_optimization", "stage"): cfg.zero.stage,
        ("optimizer", "params", "lr"): t.lr,
        ("optimizer", "params", "betas"): [t.adam_beta1, t.adam_beta2],
        ("optimizer", "params", "eps"): t.adam_eps,
        ("optimizer", "params", "weight_decay"): t.weight_decay,
    }
    for keys, value in wanted.items():
        _fill(ds, keys, value, source)
    _fill_bucket_sizes(zero, hidden_size)
    _apply_offload(cfg, zero, source)
    return ds


# Run-config field <- DeepSpeed JSON key, for values a user may choose in either place.
_JSON_TO_RUN = {
    ("zero_optimization", "stage"): ("zero", "stage"),
    ("train_micro_batch_size_per_gpu",): ("train", "micro_batch_size"),
    ("gradient_clipping",): ("train", "grad_clip"),
}


def _adopt_explicit_json_values(cfg: RunConfig, ds: dict, source: str) -> None:
    for json_keys, (section, field) in _JSON_TO_RUN.items():
        value = _get(ds, json_keys)
        sub = getattr(cfg, section)
        if value in (None, AUTO) or field in sub.model_fields_set:
            continue
        setattr(sub, field, value)


def _fill(ds: dict, keys: tuple[str, ...], value: Any, source: str) -> None:
    node = ds
    for k in keys[:-1]:
        node = node.get(k)
        if not isinstance(node, dict):
            return  # section absent (e.g. no optimizer block): nothing to fill
    current = node.get(keys[-1], AUTO)
    if current == AUTO:
        node[keys[-1]] = value
    elif not _same(current, value):
        run_key = _run_key_for(keys)
        raise ConfigError(f"{source}: {'.'.join(keys)}={current!r} contradicts {run_key}={value!r}; "
                          f"set one of them to match, or put \"auto\" in the DeepSpeed JSON")


def _run_key_for(keys: tuple[str, ...]) -> str:
    names = {"train_batch_size": "train.global_batch_size",
             "gradient_accumulation_steps": "train.global_batch_size / (micro_batch_size x dp)",
             "bf16": "model.dtype", "fp16": "model.dtype", "lr": "train.lr", "betas": "train.adam_beta1/2",
             "eps": "train.adam_eps", "weight_decay": "train.weight_decay"}
    for (j, (section, field)) in _JSON_TO_RUN.items():
        if j == keys:
            return f"{section}.{field}"
    return names.get(keys[0], names.get(keys[-1], ".".join(keys)))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b or a == b
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return a == b


def _get(ds: dict, keys: tuple[str, ...]) -> Any:
    node: Any = ds
    for k in keys:
        if not isinstance(node, dict) or k not in node:
            return None
        node = node[k]
    return node


def _fill_bucket_sizes(zero: dict, hidden: int) -> None:
    """The sizes HF's DeepSpeed integration derives from hidden_size."""
    derived = {"reduce_bucket_size": hidden * hidden, "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
               "stage3_param_persistence_threshold": 10 * hidden}
    for key, value in derived.items():
        if zero.get(key) == AUTO:
            zero[key] = value


def _apply_offload(cfg: RunConfig, zero: dict, source: str) -> None:
    for flag, key in (("offload_optimizer", "offload_optimizer"), ("offload_params", "offload_param")):
        json_device = (zero.get(key) or {}).get("device", "none")
        if flag in cfg.zero.model_fields_set:
            want = "cpu" if getattr(cfg.zero, flag) else "none"
            if key in zero and json_device != want:
                raise ConfigError(f"{source}: zero_optimization.{key}.device={json_device!r} contradicts "
                                  f"zero.{flag}={getattr(cfg.zero, flag)}; change one of them")
            if want == "cpu":
                zero.setdefault(key, {})["device"] = "cpu"
        else:
            setattr(cfg.zero, flag, json_device == "cpu")
    if cfg.zero.offload_params and cfg.zero.stage != 3:
        raise ConfigError(f"zero.offload_params needs ZeRO stage 3, got zero.stage={cfg.zero.stage}; "
                          "set zero.stage=3 or use zero.offload_optimizer")


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
    """The Engine protocol over ``deepspeed.initialize``; data parallel over the whole world."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module, ds_config: dict):
        import deepspeed

        from toolkit.compat import cpuinfo_cache, torch_extensions
        cpuinfo_cache.install()  # DeepSpeed's CPU op builders would start a subprocess per query
        torch_extensions.install()  # this environment's own JIT-built ops (no rebuilds across venvs)
        check_dtype_supported(cfg.model.dtype)
        self.cfg = cfg
        self.ds_config = ds_config
        self.router = _RouterLoss(cfg, model) if moe.is_router_model(model.config) else None
        if self.router and cfg.zero.stage == 3:
            _experts_as_leaf_modules(model)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model, model_parameters=param_groups(model, cfg.train.weight_decay), config=ds_config)
        self.dp_rank, self.dp_size = dist.get_rank(), dist.get_world_size()
        device.guard_inputs(self.engine.module, "the HF model")

    def train_step(self, micro_batches, loss_tokens, lr):
        self._set_lr(lr)
        # DeepSpeed averages gradients over DP ranks; scaling by dp makes the sum over ranks of
        # local sums / loss_tokens, i.e. the mean over the whole global batch (the loss contract).
        scale = self.dp_size / loss_tokens
        local_sum = device.zeros((), dtype=torch.float64)
        grad_norm, forward_time, skipped_before = None, device.Stopwatch(), self.engine.skipped_steps
        for i, mb in enumerate(micro_batches):
            mb = device.to_device(mb)
            forward_time.start()
            out = self._forward(mb["input_ids"])
            forward_time.stop()
            loss_sum, _ = token_loss_sum(out.logits, mb["labels"])
            objective = loss_sum * scale
            if self.router:  # DeepSpeed averages over DP: / micro-batches makes it the global mean
                objective = objective + self.router.loss(out.router_logits) / len(micro_batches)
            self.engine.backward(objective, scale_wrt_gas=False)
            if i == len(micro_batches) - 1 and self.cfg.zero.stage == 0:
                grad_norm = self._reduced_grad_norm()
            self.engine.step()
            local_sum += loss_sum.detach().double()
        dist.all_reduce(local_sum)
        skipped = self.engine.skipped_steps > skipped_before  # fp16 overflow: DeepSpeed skipped the update
        if grad_norm is None:
            grad_norm = float(self.engine.get_global_grad_norm())
        extra = self.router.stats.metrics(len(micro_batches) * self.dp_size) if self.router and self.router.stats else {}
        return StepStats(loss=local_sum.item() / loss_tokens, grad_norm=None if skipped else grad_norm,
                         compute_s=forward_time.seconds(), skipped=skipped, loss_scale=self._loss_scale(),
                         extra=extra)

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

    def _forward(self, input_ids):
        if self.router:
            return self.engine(input_ids=input_ids, output_router_logits=True)
        return self.engine(input_ids=input_ids)

    def _reduced_grad_norm(self) -> float:
        """Without ZeRO, DeepSpeed does not record the norm; the grads are all-reduced by now."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])).item()

    def _set_lr(self, lr: float) -> None:
        for group in self.engine.optimizer.param_groups:
            group["lr"] = lr

    @torch.no_grad()
    def eval_loss_sum(self, micro_batches):
        self.engine.eval()
        totals = device.zeros(2, dtype=torch.float64)
        for mb in map(device.to_device, micro_batches):
            logits = self.engine(input_ids=mb["input_ids"]).logits
            loss_sum, count = token_loss_sum(logits, mb["labels"])
            totals += torch.stack([loss_sum.double(), count.double()])
        self.engine.train()
        dist.all_reduce(totals)
        return totals[0].item(), int(totals[1].item())

    def save(self, path: Path, step: int) -> None:
        self.engine.save_checkpoint(str(path), tag=f"global_step{step}", client_state={})

    def load(self, path: Path) -> None:
        load_path, _ = self._load_checkpoint(Path(path))
        if load_path is None:
            raise RuntimeError(f"DeepSpeed found no checkpoint to load under {path}")
        replay_cpu_adam_step_counter(self.engine.basic_optimizer)

    def _load_checkpoint(self, path: Path):
        """DeepSpeed's load_checkpoint; a universal checkpoint (``toolkit convert --to zero`` writes
        one: ``latest_universal``, per-parameter files) loads at any DP size and stage, but DeepSpeed
        reads the layout from its config flag, so the flag is set for this load only."""
        config = self.engine._config
        saved = config.load_universal_checkpoint
        config.load_universal_checkpoint = saved or (path / "latest_universal").is_file()
        try:
            return self.engine.load_checkpoint(str(path), load_optimizer_states=True,
                                               load_lr_scheduler_states=False, load_module_strict=True)
        finally:
            config.load_universal_checkpoint = saved

    def export_hf(self, path: Path, tokenizer) -> None:
        import deepspeed
        module = self.engine.module
        params = list(module.parameters()) if self.cfg.zero.stage == 3 else []
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None, enabled=bool(params)):
            if self.dp_rank == 0:
                state = {k: v.detach().to("cpu", torch.float32).clone() for k, v in module.state_dict().items()}
                module.save_pretrained(str(path), state_dict=state, safe_serialization=True)
                _config_says_fp32(path)
                tokenizer.save_pretrained(str(path))
        dist.barrier()

    @property
    def module(self) -> torch.nn.Module:
        return self.engine.module

    def parameters(self):
        return self.engine.module.parameters()

    def replica_checksum(self) -> float | None:
        """Order-sensitive float64 checksum of the full parameters (identical on every DP replica
        below ZeRO-3); None at stage 3, where each rank holds only its own shard."""
        if self.cfg.zero.stage == 3:
            return None
        total = torch.zeros((), dtype=torch.float64)
        for i, p in enumerate(self.engine.module.parameters()):
            total += (i + 1) * p.detach().double().sum().cpu()
        return total.item()

    def rng_state(self) -> dict:
        return {}  # DeepSpeed draws from torch's default generators only (checkpointed by the trainer)

    def set_rng_state(self, state: dict) -> None:
        pass

    def layout(self) -> dict:
        return {"dp": self.dp_size, "tp": 1, "pp": 1, "zero_stage": self.cfg.zero.stage}


def _config_says_fp32(path: Path) -> None:
    """The exported tensors are fp32, but ``save_pretrained`` records the module's dtype (bf16/fp16
    under DeepSpeed's mixed precision) in config.json, and ``from_pretrained`` loads in that dtype."""
    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


class _RouterLoss:
    """The load-balancing loss of ``toolkit/moe.py`` from HF's ``router_logits`` (one ``[T, E]``
    tensor per MoE layer), and its statistics."""

    def __init__(self, cfg: RunConfig, model: torch.nn.Module):
        config = model.config
        self.coeff = moe.aux_loss_coeff(cfg.train.moe_aux_loss_coeff, config)
        self.top_k = getattr(config, "num_experts_per_tok", None)
        if not self.top_k:
            raise ConfigError(f"{config.model_type}: an HF mixture-of-experts config without num_experts_per_tok; "
                              "the load-balancing loss needs the router's top-k (set it in config.json)")
        self.stats: moe.RouterStats | None = None

    def loss(self, router_logits) -> torch.Tensor | float:
        """``coeff`` x the mean over MoE layers of this micro-batch's aux loss (recorded in ``stats``);
        ``router_logits``: one ``[tokens, E]`` (or ``[batch, seq, E]``) tensor per MoE layer."""
        if not router_logits:
            return 0.0  # a model without MoE layers in this configuration
        experts = router_logits[0].shape[-1]
        if self.stats is None:
            self.stats = moe.RouterStats(len(router_logits), experts)
        total = 0.0
        for layer, logits in enumerate(router_logits):
            logits = logits.reshape(-1, experts)
            counts = moe.routed_counts(logits.detach(), int(self.top_k))
            aux = moe.load_balancing_loss(logits, counts, logits.shape[0])
            self.stats.add(layer, counts, aux)
            total = total + aux
        return self.coeff * total / len(router_logits)


def _experts_as_leaf_modules(model: torch.nn.Module) -> None:
    """ZeRO-3 gathers a module's parameters in its forward hook. Where experts are modules of
    their own (transformers 4, custom MoE code), an expert that receives no tokens on one rank is
    not called there, and the ranks' gathers no longer match (a hang). Every module holding an
    ``experts`` child (transformers' sparse MoE blocks) becomes a ZeRO-3 leaf: its parameters are
    gathered all at once when the block runs (transformers 5 packs the experts into one module,
    which is always called; one gather per block is then still fewer collectives)."""
    from deepspeed.utils import set_z3_leaf_modules
    blocks = sorted({type(m) for m in model.modules() if isinstance(getattr(m, "experts", None), torch.nn.Module)},
                    key=lambda c: c.__name__)
    if blocks:
        set_z3_leaf_modules(model, blocks)


# --- exact resume with DeepSpeed's CPU Adam kernels ---------------------------------------------

def replay_cpu_adam_step_counter(optimizer) -> int:
    """Bring the C++ CPU Adam kernel's hidden step state to where an uninterrupted run has it.

    DeepSpeed's CPU Adam (FusedAdam on the CPU accelerator, and DeepSpeedCPUAdam under ZeRO-Offload
    on any machine) keeps ``beta^t`` inside the C++ optimizer object, not in the checkpoint. An
    uninterrupted run builds it as a running float product (``beta_t *= beta`` each step); a
    process that starts at step k+1 computes ``pow(beta, k+1)`` instead, which rounds differently,
    so every resumed update differed by ~1e-8 relative. Driving the kernel through steps 1..k on
    empty tensors rebuilds the same product, and the resumed run matches bit for bit.
    Returns the number of steps replayed (0 when the optimizer is not a CPU Adam kernel).
    """
    update = _cpu_adam_update_fn(optimizer)
    steps = [int(s["step"]) for s in optimizer.state.values() if "step" in s]
    if update is None or not steps:
        return 0
    group = optimizer.param_groups[0]
    beta1, beta2 = group["betas"]
    empty = torch.empty(0, dtype=torch.float32)
    for step in range(1, max(steps) + 1):
        update(step, group["lr"], beta1, beta2, group["eps"], group["weight_decay"],
               bool(group["bias_correction"]), empty)
    return max(steps)


def _cpu_adam_update_fn(optimizer):
    """A call that runs one kernel step on given tensors, or None where the kernel keeps no state."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    if isinstance(optimizer, DeepSpeedCPUAdam):
        def update(step, lr, b1, b2, eps, wd, bias_correction, t):
            optimizer.ds_opt_adam.adam_update(optimizer.opt_id, step, lr, b1, b2, eps, wd, bias_correction,
                                              t, t, t, t)
        return update
    if isinstance(optimizer, FusedAdam) and get_accelerator().device_name() == "cpu":
        def update(step, lr, b1, b2, eps, wd, bias_correction, t):
            optimizer.multi_tensor_adam(2048 * 32, optimizer._dummy_overflow_buf, [[t], [t], [t], [t]],
                                        lr, b1, b2, eps, step, optimizer.adam_w_mode, int(bias_correction), wd)
        return update
    return None  # CUDA FusedAdam and torch's Adam derive beta^t from the step on every call


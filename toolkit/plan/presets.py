"""Presets resolved into the run config before anything starts: a Megatron layout preset
(``megatron.preset``) and the DeepSpeed JSON (``zero.ds_config``, with its "auto" values filled).

Pure functions of the config: each returns a new config (and the resolved JSON), never changing
the one it was given. No backend is imported here.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from toolkit import resources
from toolkit.config import ConfigError, RunConfig
from toolkit.config_input import decode_utf8, parse_yaml
from toolkit.plan.checks import AUTOEP_PRESETS

AUTO = "auto"
PRESET_KEYS = ("tp", "pp", "vpp", "ep", "first_stage_layers", "last_stage_layers", "sequence_parallel",
               "make_vocab_size_divisible_by", "recompute", "moe_dispatcher", "attention", "fused_kernels")


# --- megatron layout presets ---------------------------------------------------------------------------

def with_megatron_preset(cfg: RunConfig) -> RunConfig:
    """``cfg`` with megatron.* fields filled from ``megatron.preset`` (a shipped preset's name or a
    YAML path); fields set explicitly in the run config win."""
    name = cfg.megatron.preset
    if not name:
        return cfg
    text, source = _read_preset("megatron", name, "megatron.preset", "megatron_configs/")
    preset = parse_yaml(text, source) or {}
    if not isinstance(preset, dict):
        raise ConfigError(f"{source}: a preset is a mapping of megatron.* layout fields, got {type(preset).__name__}")
    bad = sorted(set(preset) - set(PRESET_KEYS))
    if bad:
        raise ConfigError(f"{source}: keys {bad} are not layout fields; a preset may set only {list(PRESET_KEYS)}")
    fill = {k: v for k, v in preset.items() if k not in cfg.megatron.model_fields_set}
    return _updated(cfg, "megatron", fill, source)


def _read_preset(kind: str, name: str, field: str, folder: str) -> tuple[str, str]:
    """(text, where it came from) of a preset given as a file path or a shipped preset's name."""
    path = Path(name)
    if path.is_file():
        return decode_utf8(path.read_bytes(), str(path)), str(path)
    shipped = resources.preset(kind, name)
    if shipped is None:
        raise ConfigError(f"{field}={name!r} is neither a file nor one of {folder} {sorted(resources.presets(kind))}")
    return shipped.read_text(), f"{folder}{shipped.name}"


def _updated(cfg: RunConfig, section: str, values: dict, source: str) -> RunConfig:
    """``cfg`` with ``section``'s fields set to ``values`` (validated; marked as set)."""
    if not values:
        return cfg
    merged = {**getattr(cfg, section).model_dump(exclude_unset=True), **values}
    try:
        new_section = type(getattr(cfg, section)).model_validate(merged)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return cfg.model_copy(update={section: new_section})


# --- DeepSpeed JSON -------------------------------------------------------------------------------------

def read_ds_config(cfg: RunConfig) -> tuple[dict, str]:
    """The user's DeepSpeed JSON (a path or a shipped name) and where it came from."""
    text, source = _read_preset("deepspeed", cfg.zero.ds_config or f"zero{cfg.zero.stage}", "zero.ds_config",
                                "ds_configs/")
    try:
        return json.loads(text), source
    except json.JSONDecodeError as exc:
        raise ConfigError(f"zero.ds_config {source}: not valid JSON ({exc})") from None


# Run-config field <- DeepSpeed JSON key, for values a user may choose in either place.
_JSON_TO_RUN = {
    ("zero_optimization", "stage"): ("zero", "stage"),
    ("train_micro_batch_size_per_gpu",): ("train", "micro_batch_size"),
    ("gradient_clipping",): ("train", "grad_clip"),
}


def with_ds_json_values(cfg: RunConfig) -> RunConfig:
    """``cfg`` adopting the DeepSpeed JSON's concrete values for fields the user left at their
    defaults (``--set zero.ds_config=zero3`` alone means stage 3), offload flags included."""
    ds, source = read_ds_config(cfg)
    if "scheduler" in ds:
        raise ConfigError(f"{source} has a 'scheduler' section, but the toolkit owns the LR schedule for every "
                          "backend; remove it and set train.lr_schedule / train.warmup_steps instead")
    for json_keys, (section, field) in _JSON_TO_RUN.items():
        value = _get(ds, json_keys)
        if value not in (None, AUTO) and field not in getattr(cfg, section).model_fields_set:
            cfg = _updated(cfg, section, {field: value}, source)
    zero = ds.get("zero_optimization", {})
    offload = {}
    for flag, key in (("offload_optimizer", "offload_optimizer"), ("offload_params", "offload_param")):
        if flag not in cfg.zero.model_fields_set:
            offload[flag] = (zero.get(key) or {}).get("device", "none") == "cpu"
    cfg = _updated(cfg, "zero", offload, source)
    if cfg.zero.offload_params and cfg.zero.stage != 3:
        raise ConfigError(f"zero.offload_params needs ZeRO stage 3, got zero.stage={cfg.zero.stage}; "
                          "set zero.stage=3 or use zero.offload_optimizer")
    return cfg


def resolve_ds_config(cfg: RunConfig, dp: int, hidden: int, model_type: str = "") -> dict:
    """The DeepSpeed JSON for ``dp`` ranks: every "auto" filled from the run config (already through
    ``with_ds_json_values``); a concrete value that contradicts it is an error naming both. ``model_type``:
    the HF family (AutoEP's preset under ``zero.ep``)."""
    ds, source = read_ds_config(cfg)
    if cfg.zero.ep > 1:
        _fill_expert_parallel(ds, cfg.zero.ep, model_type, cfg.model.experts_implementation != "eager", source)
    zero = ds.setdefault("zero_optimization", {})
    for section in ("bf16", "fp16"):  # absent means off to DeepSpeed: the run's dtype must be said
        enabled = ds.setdefault(section, {}).setdefault("enabled", AUTO)
        if enabled != AUTO and bool(enabled) != (cfg.model.dtype == section):
            raise ConfigError(f"{source}: {section}.enabled={enabled!r} contradicts model.dtype={cfg.model.dtype!r}; "
                              f"set model.dtype={section if enabled else 'fp32'} or put \"auto\" in the DeepSpeed JSON")
    if "optimizer" not in ds:  # DeepSpeed would build none; the toolkit's is AdamW, set each step
        ds["optimizer"] = {"type": "AdamW", "params": {k: AUTO for k in ("lr", "betas", "eps", "weight_decay")}}
    t = cfg.train
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
    if cfg.zero.sp > 1 or "sequence_parallel_size" in ds:  # DeepSpeed's batch check: world / sp ranks of data
        wanted[("sequence_parallel_size",)] = cfg.zero.sp
    if cfg.zero.sp > 1 and cfg.zero.stage == 3:  # the one ZeRO-3 reduce path the engine corrects for sp
        zero.setdefault("reduce_scatter", AUTO)  # (adapters/deepspeed/ulysses.py: average_zero3_grads_over_dp)
        wanted[("zero_optimization", "reduce_scatter")] = True
    for keys, value in wanted.items():
        _fill(ds, keys, value, source)
    _fill_bucket_sizes(zero, hidden)
    _fill_offload(cfg, zero, source)
    return ds


AUTOEP_LAYERS = r"(?:base_model\.model\.)?model\.layers\.\d+\.mlp"
"""AutoEP's MoE layer pattern (``fullmatch``ed on module names): its presets' ``model.layers.N.mlp``, also
under peft's ``base_model.model.`` prefix, where the preset's own pattern finds nothing and AutoEP would
replace nothing, silently (the engine counts the replaced layers either way)."""


def _fill_expert_parallel(ds: dict, ep: int, model_type: str, grouped: bool, source: str) -> None:
    """``zero.ep``'s block: AutoEP over ep ranks with the family's preset, its experts as
    ``model.experts_implementation`` says (``grouped``: torch's ``_grouped_mm``, the default; ``eager``: a
    loop over the local experts). Triton's grouped-mm kernel off (it compiles C at first use, and the GPU
    image has no C toolchain for Triton: FIELD_NOTES)."""
    block = ds.setdefault("expert_parallel", {})
    wanted = {"enabled": True, "autoep_size": ep, "preset_model": AUTOEP_PRESETS.get(model_type),
              "moe_layer_pattern": AUTOEP_LAYERS, "use_grouped_mm": grouped, "disable_triton_grouped_mm": True}
    for key, value in wanted.items():
        if block.get(key, value) != value:
            raise ConfigError(f"{source}: expert_parallel.{key}={block[key]!r} contradicts zero.ep={ep} (which sets "
                              f"{key}={value!r}); remove expert_parallel from the DeepSpeed JSON")
        block[key] = value


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
        raise ConfigError(f"{source}: {'.'.join(keys)}={current!r} contradicts {_run_key_for(keys)}={value!r}; "
                          f"set one of them to match, or put \"auto\" in the DeepSpeed JSON")


def _run_key_for(keys: tuple[str, ...]) -> str:
    names = {"train_batch_size": "train.global_batch_size",
             "gradient_accumulation_steps": "train.global_batch_size / (micro_batch_size x dp)",
             "bf16": "model.dtype", "fp16": "model.dtype", "lr": "train.lr", "betas": "train.adam_beta1/2",
             "eps": "train.adam_eps", "weight_decay": "train.weight_decay", "sequence_parallel_size": "zero.sp",
             "reduce_scatter": "zero.sp > 1 at ZeRO-3 (its only reduce path the toolkit corrects for sp)"}
    if keys in _JSON_TO_RUN:
        section, field = _JSON_TO_RUN[keys]
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


def _fill_offload(cfg: RunConfig, zero: dict, source: str) -> None:
    """The JSON's offload devices agree with the run config's flags (explicit flags win over the
    JSON only when they do not contradict it)."""
    for flag, key in (("offload_optimizer", "offload_optimizer"), ("offload_params", "offload_param")):
        want = "cpu" if getattr(cfg.zero, flag) else "none"
        json_device = (zero.get(key) or {}).get("device", "none")
        if json_device not in ("cpu", "none"):
            raise ConfigError(f"{source}: zero_optimization.{key}.device={json_device!r}: the toolkit offloads to "
                              "the CPU only (zero.offload_optimizer / zero.offload_params); use \"cpu\" or \"none\"")
        if key in zero and json_device != want:
            raise ConfigError(f"{source}: zero_optimization.{key}.device={json_device!r} contradicts "
                              f"zero.{flag}={getattr(cfg.zero, flag)}; change one of them")
        if want == "cpu":
            zero.setdefault(key, {})["device"] = "cpu"

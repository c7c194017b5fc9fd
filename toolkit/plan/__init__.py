"""The resolved run plan: made once, before any process starts, then only read.

``build_plan(cfg, worlds)`` applies the presets (a Megatron layout preset, the DeepSpeed JSON's
concrete values), derives the model spec from the HF config, checks the layout for each world size
the job may run at (an elastic job: every node count in ``--nnodes MIN:MAX``) and resolves the
DeepSpeed JSON for each. ``toolkit train`` writes it to ``RUN_DIR/plan.json``; every rank reads that
file (``read_plan``), so no rank re-reads the YAML, the presets or the HF config. ``toolkit
estimate``, ``--dry-run`` and the converter build their plans the same way.

  plan.config     the validated run config, presets applied (never changed afterwards)
  plan.model      ``ModelSpec``: family, HF config, dimensions, parameter counts, MoE shape
  plan.layouts    ``Layout`` per world size (``plan.layout(world)``)
  plan.ds_configs the resolved DeepSpeed JSON per world size (``plan.ds_config(world)``)
  plan.lora       ``LoraSpec`` (``lora/spec.py``): LoRA resolved against the model's modules; None: off
  plan.objective  the training objective (``toolkit/objectives/``), resolved from the config once per process
"""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, ConfigDict

from toolkit import __version__
from toolkit.config import ConfigError, RunConfig
from toolkit.layout import Layout
from toolkit.lora.spec import LoraSpec, resolve_lora
from toolkit.objectives import Objective, resolve
from toolkit.plan.checks import check_layout, check_vision
from toolkit.plan.model import ModelSpec, load_hf_config, model_code_dir, model_spec, read_config_json
from toolkit.plan.presets import resolve_ds_config, with_ds_json_values, with_megatron_preset

PLAN_FILE = "plan.json"

__all__ = ["Plan", "build_plan", "read_plan", "write_plan", "PLAN_FILE", "Layout", "ModelSpec"]


class Plan(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    config: RunConfig
    model: ModelSpec
    layouts: dict[int, Layout]
    ds_configs: dict[int, dict] = {}
    lora: LoraSpec | None = None
    toolkit_version: str = __version__

    def layout(self, world: int) -> Layout:
        if world not in self.layouts:
            raise ConfigError(f"this job has {world} ranks, but its plan was made for {sorted(self.layouts)}; "
                              "launch it with the node counts it was planned for (--nnodes)")
        return self.layouts[world]

    @cached_property
    def objective(self) -> Objective:
        """What the engines' backward starts from and the trainer counts (``toolkit/objectives/``)."""
        return resolve(self.config)

    def trainable_parameters(self) -> tuple[int, int]:
        """(trained, all) parameters: a LoRA run trains its adapters (and modules to save, whose
        trained copies sit beside the frozen originals); otherwise every parameter trains."""
        if self.lora is None:  # a vision-language model's frozen tower (docs/vlm.md) does not train
            frozen = self.model.vision_unused if not self.config.model.freeze_vision else self.model.vision
            return self.model.total - frozen, self.model.total
        return self.lora.trainable, self.model.total + self.lora.trainable

    def ds_config(self, world: int) -> dict:
        self.layout(world)
        return self.ds_configs[world]


def build_plan(cfg: RunConfig, worlds: list[int], hf_config=None) -> Plan:
    """Resolve ``cfg`` for jobs of each size in ``worlds``; errors name the field and the fix.
    ``hf_config``: the model's HF config when the caller has it (else read from model.name_or_path)."""
    cfg = with_megatron_preset(cfg) if cfg.backend == "megatron" else with_ds_json_values(cfg)
    # config.json as written, where the config comes from it (a given hf_config is taken as it is)
    written = read_config_json(cfg.model.name_or_path) if hf_config is None else None
    if hf_config is None:
        hf_config = load_hf_config(cfg.model.name_or_path, cfg.model.trust_remote_code)
    from toolkit.families.vision import is_vision_config
    vision = is_vision_config(hf_config)
    if vision:  # a vision-language model: what its path takes (docs/vlm.md)
        check_vision(cfg, hf_config)
    if cfg.model.quantize != "none":  # a 4-bit base: its refusals first (megatron has no such path)
        from toolkit.device import rank_device
        from toolkit.lora.quant import check_quantize
        check_quantize(cfg, hf_config, rank_device().type)
    if cfg.backend == "megatron" and not vision:
        _check_family(cfg, hf_config, written)
    spec = model_spec(hf_config, model_code_dir(cfg.model.name_or_path, hf_config))
    layouts = {w: check_layout(cfg, spec, w) for w in sorted(set(worlds))}
    ds = {w: resolve_ds_config(cfg, lay.dp, spec.hidden, spec.model_type) for w, lay in layouts.items()} \
        if cfg.backend == "deepspeed" else {}
    return Plan(config=cfg, model=spec, layouts=layouts, ds_configs=ds, lora=_lora(cfg, hf_config))


def _lora(cfg: RunConfig, hf_config) -> LoraSpec | None:
    """LoRA checked against the model's module names (a meta-device model: no memory)."""
    if not cfg.lora.enabled:
        return None
    from toolkit.families.meta import meta_model
    spec = resolve_lora(cfg.lora, meta_model(hf_config))
    if cfg.backend == "megatron":
        from toolkit.families import get_family
        from toolkit.lora.geometry import check_megatron_lora
        check_megatron_lora(spec, get_family(hf_config.model_type), hf_config)
    return spec


def _check_family(cfg: RunConfig, hf_config, written: dict | None) -> None:
    """The megatron path needs a family table for the model, and a config it can honour exactly
    (``written``: config.json as written, whose shape fields must all be there)."""
    from toolkit.families import FamilyError, get_family
    try:
        family = get_family(hf_config.model_type)
        family.check(hf_config)
    except FamilyError as exc:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: {exc}") from None
    if family.sliding_windows(hf_config) and cfg.megatron.attention == "local":
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: sliding_window="
                          f"{getattr(hf_config, 'sliding_window', None)} needs the toolkit's core attention; "
                          "megatron's local one has no window: set megatron.attention=auto")
    if family.attention_softcap and family.attention_softcap(hf_config) and cfg.megatron.attention == "local":
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: attention logit softcapping needs "
                          "the toolkit's core attention: set megatron.attention=auto")
    missing = family.missing_fields(written) if written is not None else []
    if missing:
        raise ConfigError(f"model.name_or_path={cfg.model.name_or_path!r}: config.json has no {', '.join(missing)}; "
                          "the megatron model is built from them: add them as the model's published config.json "
                          "has them (transformers' class defaults are not this checkpoint's shapes)")


def write_plan(plan: Plan, run_dir: Path) -> Path:
    """RUN_DIR/plan.json, replaced whole (nodes writing it together leave one complete file)."""
    from toolkit.storage import write_text_atomic
    path = Path(run_dir) / PLAN_FILE
    write_text_atomic(path, plan.model_dump_json(indent=2))
    return path


def read_plan(path: Path) -> Plan:
    path = Path(path)
    try:
        return Plan.model_validate_json(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a run plan this toolkit ({__version__}) can read ({exc}); "
                          "start the run with toolkit train, which writes it") from None

"""Which format a path holds, and its reader. A toolkit run directory means its newest complete
checkpoint; a toolkit checkpoint directory means its ``engine/``."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.convert.canonical import Source
from toolkit.convert.errors import ConvertError
from toolkit.convert.staging import check_manifest

SOURCE_FORMATS_HELP = "an HF save_pretrained directory, a DeepSpeed checkpoint (global_stepN/ or the folder holding " \
          "'latest'), a megatron-core torch_dist directory, a Megatron-LM legacy mp_rank_XX checkpoint, or a " \
          "toolkit run/checkpoint directory"


@dataclass(frozen=True)
class Located:
    """A checkpoint found on disk before any tensor of it is read (torch-free, so the direct
    ZeRO -> HF route can decide without importing a reader): its format, the folder its reader
    opens, the HF config, and a toolkit checkpoint's trainer state."""
    format: str
    """hf | megatron | megatron-legacy | zero | zero-universal"""
    path: Path
    hf_config: dict
    extras: dict = field(default_factory=dict)


def open_source(path, hf_config: str | None = None) -> Source:
    return open_located(locate(path, hf_config))


def locate(path, hf_config: str | None = None) -> Located:
    """Which format ``path`` holds, where, and its config (a damaged manifest is refused here)."""
    from toolkit.convert.hf import is_hf_dir
    from toolkit.convert.zero_index import find_tag_dir
    path = Path(path)
    if not path.exists():
        raise ConvertError(f"{path}: no such file or directory")
    path = resolve_run_dir(path)
    _refuse_lora(path)
    check_manifest(path)
    config = _explicit_config(hf_config)
    if is_hf_dir(path):
        return Located("hf", path, config or json.loads((path / "config.json").read_text()))
    mdir = find_dist_dir(path)
    if mdir is not None:
        return Located("megatron", mdir, config or _config_near(mdir), _toolkit_extras(mdir))
    legacy = find_legacy_dir(path)
    if legacy is not None:
        return Located("megatron-legacy", legacy, config or _config_near(legacy))
    tag = find_tag_dir(path)
    if tag is not None:
        kind = "zero-universal" if (tag / "zero" / "optimizer_state.pt").is_file() else "zero"
        return Located(kind, tag, config or _config_near(tag), _toolkit_extras(tag))
    raise ConvertError(f"{path}: unknown checkpoint format; expected {SOURCE_FORMATS_HELP}")


def open_located(found: Located) -> Source:
    """The reader of a located checkpoint (these import torch)."""
    from toolkit.convert import hf, megatron, megatron_legacy, zero
    if found.format == "hf":
        return hf.HFSource(found.path, found.hf_config)
    if found.format == "megatron":
        return megatron.MegatronSource(found.path, found.hf_config, **found.extras)
    if found.format == "megatron-legacy":
        return megatron_legacy.LegacySource(found.path, found.hf_config)
    cls = zero.UniversalSource if found.format == "zero-universal" else zero.ZeroSource
    return cls(found.path, found.hf_config, **found.extras)


def find_dist_dir(path: Path) -> Path | None:
    """A megatron-core ``torch_dist`` checkpoint: the folder (or its ``engine/``) with its metadata.json."""
    for cand in (path, path / "engine"):
        meta = cand / "metadata.json"
        if meta.is_file():
            try:
                if json.loads(meta.read_text()).get("sharded_backend") == "torch_dist":
                    return cand
            except ValueError:
                raise ConvertError(f"{meta}: not valid JSON; the checkpoint is damaged") from None
    return None


def find_legacy_dir(path: Path) -> Path | None:
    """Megatron-LM's ``iter_XXXXXXX/mp_rank_XX[_YYY]/model_optim_rng.pt`` (the folder holding them)."""
    tracker = path / "latest_checkpointed_iteration.txt"
    if tracker.is_file():
        it = tracker.read_text().strip()
        path = path / ("release" if it == "release" else f"iter_{int(it):07d}")
    if any(path.glob("mp_rank_*/model_optim_rng.pt")):
        return path
    return None


def resolve_run_dir(path: Path) -> Path:
    if (path / "checkpoints").is_dir() and not (path / "engine").exists():
        from toolkit.storage import newest_complete
        found = newest_complete(path / "checkpoints", log=lambda m: None)
        if found is None:
            raise ConvertError(f"{path}: a run directory without a complete checkpoint")
        return found
    return path


def is_lora_source(src) -> bool:
    """An HF-PEFT directory, or a toolkit LoRA checkpoint (or the run directory holding one)."""
    from toolkit.lora.files import is_peft_dir, lora_checkpoint_meta
    src = Path(src)
    return src.exists() and (is_peft_dir(src) or lora_checkpoint_meta(resolve_run_dir(src)) is not None)


def _refuse_lora(path: Path) -> None:
    """LoRA runs (``lora.rank > 0``) checkpoint their adapters only, and export ``hf_final/`` (merged)
    and ``adapter/`` (HF-PEFT). ``convert`` takes a LoRA checkpoint or an HF-PEFT directory whole
    (``lora/convert.py``), never as a ZeRO or HF source of the model: say so, not "unknown format"
    or missing tensors (``toolkit inspect`` describes both)."""
    from toolkit.lora.files import is_peft_dir, lora_checkpoint_meta
    if is_peft_dir(path):
        raise ConvertError(f"{path}: an HF-PEFT adapter directory (LoRA); it converts only as a whole: toolkit "
                           "convert DIR OUT --to hf [--base BASE_DIR] (merged onto its base) or --to peft")
    found = lora_checkpoint_meta(path)
    if found is not None:
        ckpt, meta = found
        raise ConvertError(f"{ckpt}: a LoRA checkpoint (adapters only, base {meta.get('base_model', {}).get('path')}); "
                           "it converts only as a whole: toolkit convert CKPT OUT --to peft (the adapter) or --to hf "
                           "(merged onto its base)")


def _explicit_config(hf_config: str | None) -> dict | None:
    if hf_config is None:
        return None
    p = Path(hf_config)
    p = p / "config.json" if p.is_dir() else p
    if not p.is_file():
        raise ConvertError(f"--hf-config {hf_config}: no config.json there")
    return json.loads(p.read_text())


def _config_near(path: Path) -> dict:
    """config.json beside the checkpoint: in it, or up to two levels above (engine/, step dir,
    an HF Trainer ``checkpoint-N/`` holding ``global_stepN/``)."""
    for cand in (path, path.parent, path.parent.parent):
        if (cand / "config.json").is_file():
            return json.loads((cand / "config.json").read_text())
    raise ConvertError(f"{path}: no config.json beside the checkpoint, so the model architecture is unknown; "
                       "pass --hf-config PATH (the model's config.json or its directory)")


def _toolkit_extras(path: Path) -> dict:
    """trainer.json of a toolkit checkpoint (step, samples, seed) when SRC is one."""
    for cand in (path.parent, path.parent.parent):
        if (cand / "trainer.json").is_file():
            return {"trainer_state": json.loads((cand / "trainer.json").read_text())}
    return {}


def inspect(path, hf_config: str | None = None) -> dict:
    """A checkpoint described: format, family, layout, step, parameters, dtypes, size, optimizer
    state, completeness (a manifest that verifies, or none to check)."""
    from toolkit.lora.files import inspect_lora_checkpoint, inspect_peft, is_peft_dir, lora_checkpoint_meta
    from toolkit.storage import MANIFEST
    if Path(path).exists() and is_peft_dir(Path(path)):
        return inspect_peft(Path(path))
    lora = lora_checkpoint_meta(resolve_run_dir(Path(path))) if Path(path).exists() else None
    if lora is not None:
        return inspect_lora_checkpoint(*lora)
    src = open_source(path, hf_config)
    try:
        root = Path(path)
        size = sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
        dtypes = sorted({str(i.dtype).removeprefix("torch.") for i in src.infos.values()})
        manifest = next((c for c in (root, root.parent, root.parent.parent) if (c / MANIFEST).is_file()), None)
        return {"path": str(root), "format": src.format, "family": src.model_type, "layout": src.layout,
                "step": src.step, "parameters": src.num_params(), "tensors": len(src.infos), "dtypes": dtypes,
                "bytes_on_disk": size, "optimizer_state": src.has_optimizer, "tied_embeddings": src.tied,
                "complete": True, "manifest": str(manifest / MANIFEST) if manifest else None,
                **runs_on(src.hf_config)}
    finally:
        src.close()


def runs_on(config: dict) -> dict:
    """Where the model can train: DeepSpeed takes any transformers causal LM; megatron needs a family
    table and a config it honours exactly, then the TP/PP/EP sizes that split it evenly."""
    from toolkit.convert.canonical import hf_config_object
    from toolkit.families import FamilyError, find_family, supported
    from toolkit.plan.layout import divisors, valid_tp
    family = find_family(config.get("model_type"))
    if family is None:
        return {"deepspeed": "ZeRO 0-3", "megatron": f"no family for model_type={config.get('model_type')!r} "
                                                     f"(supported: {', '.join(supported())})"}
    missing = family.missing_fields(config)
    if missing:
        return {"deepspeed": "ZeRO 0-3", "megatron": f"config.json has no {', '.join(missing)}"}
    try:
        family.check(hf_config_object(config))
    except FamilyError as exc:
        return {"deepspeed": "ZeRO 0-3", "megatron": str(exc).replace("\n  ", "; ")}
    heads, kv_heads, layers = split_dims(config)
    experts = family.num_experts(hf_config_object(config))
    layout = (f"tp in {valid_tp(heads, kv_heads)}, pp in {divisors(layers)} "
              "(or uneven with first/last_stage_layers)")
    return {"deepspeed": "ZeRO 0-3", "megatron": layout + (f", ep in {divisors(experts)}" if experts else "")}


def split_dims(config: dict) -> tuple[int, int, int]:
    """(heads, KV heads, layers) of a config.json as written (GPT-2's names too; KV heads default to
    the heads, as transformers reads a config without them)."""
    heads = config.get("num_attention_heads", config.get("n_head"))
    return heads, config.get("num_key_value_heads") or heads, config.get("num_hidden_layers", config.get("n_layer"))


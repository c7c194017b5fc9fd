"""``inspect``: what a checkpoint is (format, family, layout, step, sizes, completeness) and where
it can train; LoRA adapters are described by ``lora/files.py``."""
from __future__ import annotations

from pathlib import Path

from toolkit.formats.detect import open_source, resolve_run_dir


def inspect(path, hf_config: str | None = None) -> dict:
    """A checkpoint described: format, family, layout, step, parameters, dtypes, size, optimizer
    state, completeness (a manifest that verifies, or none to check)."""
    from toolkit.lora.files import (
        find_peft_dcp,
        inspect_lora_checkpoint,
        inspect_peft,
        is_peft_dir,
        lora_checkpoint_meta,
    )
    from toolkit.storage import MANIFEST
    if Path(path).exists() and is_peft_dir(Path(path)) and find_peft_dcp(Path(path)) is None:
        return inspect_peft(Path(path))
    if Path(path).exists() and find_peft_dcp(Path(path)) is not None:
        from toolkit.lora.dcp import dcp_hf_config, inspect_peft_dcp
        return inspect_peft_dcp(Path(path), dcp_hf_config(Path(path), hf_config))
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
    table and a config it honours exactly, then the TP/PP/CP/EP sizes that split it evenly."""
    from toolkit.families import FamilyError, find_family, supported
    from toolkit.formats.canonical import hf_config_object
    from toolkit.layout import divisors, valid_tp
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
              f"(or uneven with first/last_stage_layers), cp in {divisors(heads)} at tp=1 (a divisor of heads / tp; "
              "data.seq_len a multiple of 2 x cp)")
    return {"deepspeed": "ZeRO 0-3", "megatron": layout + (f", ep in {divisors(experts)}" if experts else "")}


def split_dims(config: dict) -> tuple[int, int, int]:
    """(heads, KV heads, layers) of a config.json as written (GPT-2's names too; KV heads default to
    the heads, as transformers reads a config without them)."""
    heads = config.get("num_attention_heads", config.get("n_head"))
    return heads, config.get("num_key_value_heads") or heads, config.get("num_hidden_layers", config.get("n_layer"))


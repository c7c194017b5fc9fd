"""``inspect``: what a checkpoint is (format, family, layout, step, sizes, completeness) and where
it can train; a format not read as a stream (LoRA adapters) describes itself (``table.Format.inspector``)."""
from __future__ import annotations

from pathlib import Path

from toolkit.formats.detect import locate, open_located
from toolkit.formats.table import by_name


def inspect(path, hf_config: str | None = None) -> dict:
    """A checkpoint described: format, family, layout, step, parameters, dtypes, size, optimizer
    state, completeness (a manifest that verifies, or none to check)."""
    from toolkit.storage import MANIFEST
    found = locate(path, hf_config)
    fmt = by_name(found.format)
    if fmt.inspector is not None:
        return fmt.inspect(found, hf_config)
    src = open_located(found)
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
    if isinstance(config.get("vision_config"), dict):
        from toolkit.families.vision import describe
        return {"deepspeed": "ZeRO 0-3 (docs/vlm.md)", "megatron": "refused: the megatron path has no vision tower",
                "vision": describe(config)}
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


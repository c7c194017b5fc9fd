"""``toolkit inspect`` of LoRA adapters, read without torch: an HF-PEFT directory
(``adapter_config.json`` + ``adapter_model.safetensors``, as a LoRA run's ``adapter/``) or a toolkit
LoRA checkpoint (adapters only; ``meta.json`` holds the resolved ``lora`` spec and its base).
``toolkit convert`` does not read adapters yet (``detect.py`` says so by name)."""
from __future__ import annotations

import json
import math
import struct
from pathlib import Path

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def is_peft_dir(path: Path) -> bool:
    return (Path(path) / PEFT_CONFIG).is_file()


def lora_checkpoint_meta(path: Path) -> tuple[Path, dict] | None:
    """(checkpoint directory, its meta.json) when ``path`` is in a toolkit LoRA checkpoint."""
    for cand in (path, path.parent, path.parent.parent):
        meta = cand / "meta.json"
        if meta.is_file():
            data = json.loads(meta.read_text())
            if isinstance(data, dict) and "lora" in data:
                return cand, data
    return None


def inspect_peft(path: Path) -> dict:
    """Rank, alpha, targets and the trained parameters of an HF-PEFT adapter directory."""
    path = Path(path)
    config = json.loads((path / PEFT_CONFIG).read_text())
    tensors = _safetensors_shapes(path / PEFT_WEIGHTS) if (path / PEFT_WEIGHTS).is_file() else {}
    return {"path": str(path), "format": "peft", "peft_type": config.get("peft_type"), "rank": config.get("r"),
            "alpha": config.get("lora_alpha"), "targets": config.get("target_modules"),
            "modules_to_save": config.get("modules_to_save"), "base_model": config.get("base_model_name_or_path"),
            "trainable_params": sum(math.prod(shape) for shape, _ in tensors.values()), "tensors": len(tensors),
            "dtypes": sorted({dtype for _, dtype in tensors.values()}), "bytes_on_disk": _size(path)}


def inspect_lora_checkpoint(ckpt: Path, meta: dict) -> dict:
    """A toolkit LoRA checkpoint: its step and layout, the adapters' spec, the base it needs."""
    from toolkit.storage import COMPLETE, MANIFEST
    lora, base = meta["lora"], meta.get("base_model", {})
    return {"path": str(ckpt), "format": f"{meta['format']} (LoRA adapters only)", "family": meta.get("family"),
            "layout": meta.get("layout"), "step": meta.get("step"), "rank": lora["rank"], "alpha": lora["alpha"],
            "targets": lora["targets"], "modules_to_save": lora["modules_to_save"],
            "trainable_params": lora["trainable"], "base_model": base.get("path"),
            "base_fingerprint": base.get("fingerprint"), "bytes_on_disk": _size(ckpt),
            "complete": (ckpt / COMPLETE).is_file() and (ckpt / MANIFEST).is_file()}


def _safetensors_shapes(path: Path) -> dict[str, tuple[list[int], str]]:
    """name -> (shape, dtype) from a safetensors header (8-byte little-endian length, then JSON)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    return {n: (v["shape"], v["dtype"]) for n, v in header.items() if n != "__metadata__"}


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# --- toolkit convert of a LoRA checkpoint: --to peft (the adapter) or --to hf (merged) -------------

def convert_lora(ckpt: Path, meta: dict, dst: Path, to: str, max_shard_bytes: int) -> dict:
    """A toolkit LoRA checkpoint (adapters only) as an HF-PEFT directory (``--to peft``: no base
    needed) or as the merged HF model (``--to hf``: the base named in meta.json, refused when its
    fingerprint differs), both in fp32, written staged. The trained tensors come from the ZeRO
    reader (``zero.py``), by peft name."""
    from toolkit.convert.errors import ConvertError
    from toolkit.convert.staging import staged
    from toolkit.convert.zero import ZeroSource
    from toolkit.convert.zero_index import find_tag_dir
    from toolkit.plan.lora import LoraSpec
    from toolkit.storage import meta as meta_io
    if to not in ("hf", "peft"):
        raise ConvertError(f"{ckpt}: a LoRA checkpoint converts --to peft (the adapter) or --to hf (merged), "
                           f"not --to {to}")
    tag = find_tag_dir(ckpt / "engine")
    if tag is None or meta["layout"].get("zero_stage", 0) == 0:
        raise ConvertError(f"{ckpt}: the ZeRO reader reads stages 1-3; this LoRA checkpoint was written at "
                           f"{meta['layout']}; use its run's adapter/ and hf_final/")
    hf_config, spec = meta_io.read_hf_config(ckpt), LoraSpec(**meta["lora"])
    trained = ZeroSource(tag, hf_config)
    try:
        tensors = {n: trained.read(n) for n in trained.infos}
        with staged(Path(dst)) as stage:
            if to == "peft":
                write_peft(spec, hf_config, tensors, stage, meta.get("base_model", {}).get("path"))
            else:
                _write_merged(spec, hf_config, tensors, stage, _base_source(ckpt, meta, hf_config), max_shard_bytes)
    finally:
        trained.close()
    return {"src": str(ckpt), "dst": str(dst), "from": f"{meta['format']} (LoRA)", "to": to,
            "family": hf_config.get("model_type"), "tensors": len(tensors), "step": meta.get("step"),
            "optimizer_state": False, "reader": "torch", "seconds": 0.0}


def write_peft(spec, hf_config: dict, trained: dict, out: Path, base_name: str | None) -> None:
    """``adapter_config.json`` + ``adapter_model.safetensors`` from the trained tensors (peft names),
    keyed as peft keys them: its own ``get_peft_model_state_dict`` on the model built on the meta
    device (no weights are made)."""
    from accelerate import init_empty_weights
    from peft import get_peft_model, get_peft_model_state_dict
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from toolkit.plan.lora import ADAPTER, peft_config
    from toolkit.convert.canonical import hf_config_object
    with init_empty_weights():
        model = get_peft_model(AutoModelForCausalLM.from_config(hf_config_object(hf_config)), peft_config(spec))
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    if expected != set(trained):
        from toolkit.convert.errors import ConvertError
        raise ConvertError(f"the checkpoint's trained tensors are not this LoRA spec's: missing "
                           f"{sorted(expected - set(trained))[:5]}, unexpected {sorted(set(trained) - expected)[:5]}")
    config = model.peft_config[ADAPTER]
    config.base_model_name_or_path = base_name
    config.save_pretrained(str(out))
    tensors = get_peft_model_state_dict(model, state_dict=trained, adapter_name=ADAPTER)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / PEFT_WEIGHTS), metadata={"format": "pt"})


def _base_source(ckpt: Path, meta: dict, hf_config: dict):
    """The converter's HF reader of the checkpoint's base, after checking its fingerprint."""
    from toolkit.convert.errors import ConvertError
    from toolkit.convert.hf import HFSource
    from toolkit.storage.meta import base_model_record
    base = meta.get("base_model", {})
    if base.get("init") != "pretrained":
        raise ConvertError(f"{ckpt}: the LoRA base was a random init (seed); --to hf needs a pretrained base: "
                           "use the run's hf_final/, or --to peft")
    now = base_model_record(base["path"], "pretrained", 0)
    if now["fingerprint"] != base["fingerprint"]:
        raise ConvertError(f"{ckpt}: its base {base['path']} has changed (fingerprint {now['fingerprint']}, "
                           f"trained on {base['fingerprint']}); merging onto it would be wrong")
    return HFSource(Path(base["path"]), hf_config)


def _write_merged(spec, hf_config: dict, trained: dict, out: Path, base, max_shard_bytes: int) -> None:
    from toolkit.convert.hf import write_hf
    try:
        write_hf(merged_source(base, spec, trained), out, max_shard_bytes=max_shard_bytes)
    finally:
        base.close()


def merged_source(base, spec, trained: dict):
    """The base's HF reader with each adapted weight merged, W + (alpha / r) x B @ A in fp32, and
    each module to save replaced by its trained copy (peft's ``merge_and_unload``); every tensor fp32.
    Read whole, one at a time (no memory-mapped pieces: the writer must call ``read``)."""
    import torch

    from toolkit.plan.lora import ADAPTER, PEFT_PREFIX, merged_weight
    from toolkit.convert.canonical import Source, TensorInfo
    pairs, saved = {}, {}
    for name, tensor in trained.items():
        hf = name.removeprefix(PEFT_PREFIX)
        if f".lora_A.{ADAPTER}." in hf:
            pairs[f"{hf.split(f'.lora_A.{ADAPTER}.')[0]}.weight"] = (tensor, trained[name.replace(".lora_A.", ".lora_B.")])
        elif f".modules_to_save.{ADAPTER}." in hf:
            saved[hf.replace(f".modules_to_save.{ADAPTER}.", ".")] = tensor

    class Merged(Source):
        def read(self, name: str, state: str = "param"):
            if name in saved:
                return saved[name].float()
            tensor = base.read(name, state)
            if name not in pairs:
                return tensor.float()
            return merged_weight(tensor, *pairs[name], spec.scaling, spec.fan_in_fan_out)

    missing = sorted(set(pairs) - set(base.infos)) + sorted(set(saved) - set(base.infos))
    if missing:
        from toolkit.convert.errors import ConvertError
        raise ConvertError(f"the base checkpoint lacks the adapted tensors {missing[:5]}")
    return Merged(path=base.path, format="hf-merged", hf_config={**base.hf_config, "dtype": "float32"},
                  infos={n: TensorInfo(tuple(i.shape), torch.float32) for n, i in base.infos.items()},
                  carry_files=list(base.carry_files))

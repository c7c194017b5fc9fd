"""A PyTorch distributed checkpoint (DCP) of an FSDP2 model wrapped by peft (LoRA): converted whole
through ``lora/convert.py``'s paths, ``--to peft`` (the adapter) or ``--to hf`` (merged onto the
base weights the DCP itself holds).

``get_model_state_dict`` of a ``get_peft_model`` model under ``fully_shard`` names every tensor by
peft's parameter name (peft 0.21): ``base_model.model.<HF name>`` for an untouched weight,
``base_model.model.<module>.base_layer.weight`` for an adapted layer's frozen weight, and
``base_model.model.<module>.lora_{A,B}.default.weight`` for the adapters. The adapter's settings
(alpha, and so the scaling) are not in the DCP: peft's ``adapter_config.json`` beside it (in the DCP
directory or up to two levels above: HF Trainer's ``checkpoint-N/``) is required, as HF Trainer and
``PeftModel.save_pretrained`` write it. Rank and targets alone are read from the tensors (``inspect``).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from toolkit.formats.canonical import TensorInfo
from toolkit.formats.dcp import DCPSource
from toolkit.formats.errors import ConvertError
from toolkit.formats.peft import PEFT_CONFIG
from toolkit.lora.peft import ADAPTER, PEFT_PREFIX

LORA_KEY = re.compile(rf"\.(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)\.{ADAPTER}\b|\.modules_to_save\.")


def _config_path(folder: Path) -> Path | None:
    return next((c / PEFT_CONFIG for c in (folder, folder.parent, folder.parent.parent) if (c / PEFT_CONFIG).is_file()),
                None)


class PeftBaseSource(DCPSource):
    """The base model's weights in a peft model's DCP, under HF names (an adapted layer's
    ``base_layer.weight`` as its ``weight``, a module to save's ``original_module``), for the merge."""

    def __init__(self, path: Path, hf_config: dict, **kw):
        self._key: dict[str, str] = {}  # HF name -> DCP key (without the "model." prefix)
        self.adapter_keys: list[str] = []
        super().__init__(path, hf_config, format="dcp (peft LoRA)", **kw)

    def dirs(self, path: Path):
        from toolkit.formats.describe import ACCELERATE_MODEL, ACCELERATE_OPTIM
        if (path / ACCELERATE_MODEL).is_dir():
            self.optim_key = "optimizer"
            optim = path / ACCELERATE_OPTIM
            return path / ACCELERATE_MODEL, optim if (optim / ".metadata").is_file() else None
        return path, path

    def _model_infos(self, tensors: dict) -> dict[str, TensorInfo]:
        infos = {}
        for key, meta in tensors.items():
            name = key[len(self.model_prefix):] if key.startswith(self.model_prefix) else None
            if name is None:
                continue
            if LORA_KEY.search(name):
                self.adapter_keys.append(name)
                continue
            if not name.startswith(PEFT_PREFIX):
                raise ConvertError(f"{self.path}: {name!r} is not a peft model's parameter name (base_model.model.*); "
                                   "a DCP of a model wrapped by peft's get_peft_model is expected")
            hf = name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".").replace(".original_module.", ".")
            self._key[hf] = name
            infos[hf] = TensorInfo(tuple(meta.size), meta.properties.dtype)
        if self.tied:
            infos.pop("lm_head.weight", None)
        return infos

    def read(self, name: str, state: str = "param") -> torch.Tensor:
        if state != "param":
            raise ConvertError(f"{self.path}: the base weights of a peft model are frozen; they have no {state}")
        return self._model.tensor(self.model_prefix + self._key[name])

    def adapter_tensor(self, name: str) -> torch.Tensor:
        return self._model.tensor(self.model_prefix + name).float()


def lora_shapes(source: PeftBaseSource) -> dict:
    """Rank(s) and target modules as the adapter tensors' names and shapes say them."""
    sites = {re.sub(r"\.lora_A\..*", "", n) for n in source.adapter_keys if ".lora_A." in n}
    ranks = sorted({int(source._model.md.state_dict_metadata[source.model_prefix + n].size[0])
                    for n in source.adapter_keys if ".lora_A." in n})
    return {"ranks": ranks, "targets": sorted({s.rpartition(".")[2] for s in sites}), "adapted_layers": len(sites)}


def adapter_from_dcp(path: Path, base: str | None, hf_config: dict):
    """(the ``Adapter``, the DCP's base weights as a ``Source``): peft's meta model from the
    adapter_config.json beside the DCP, its trained tensors from the DCP (every one, exactly)."""
    from peft import PeftConfig

    from toolkit.lora.adapter import Adapter, assign_trained, check_mergeable
    from toolkit.lora.checkpoint import meta_peft_model
    source = PeftBaseSource(Path(path), hf_config)
    config_path = _config_path(Path(path))
    if config_path is None:
        found = lora_shapes(source)
        source.close()
        raise ConvertError(f"{path}: a DCP of a peft LoRA model (rank {found['ranks']}, targets {found['targets']}) "
                           f"without peft's {PEFT_CONFIG} beside it; its lora_alpha (the scaling) is not in the DCP. "
                           "Put the adapter_config.json the run wrote (PeftModel.save_pretrained / HF Trainer) in "
                           "the DCP directory or its parent")
    config = PeftConfig.from_pretrained(str(config_path.parent))
    config.inference_mode = False
    check_mergeable(config, config_path.parent)
    model = meta_peft_model(hf_config, config)
    assign_trained(model, {n: source.adapter_tensor(n) for n in source.adapter_keys}, f"{path} with {config_path}")
    adapter = Adapter(model, hf_config, base or config.base_model_name_or_path)
    adapter.base_source = source
    return adapter


def adapter_of_dcp(found, base: str | None, hf_config: str | None = None):
    """The table's ``lora_adapter`` of a DCP of a peft model: (its ``Adapter``, {format, step})."""
    adapter = adapter_from_dcp(found.path, base, dcp_hf_config(found.path, hf_config))
    return adapter, {"format": adapter.base_source.format, "step": adapter.base_source.step}


def refuse_as_checkpoint(found, base: str | None):
    """The table's ``lora_checkpoint`` of a DCP of a peft model: none (its run is not the toolkit's)."""
    raise ConvertError(f"{found.path}: a DCP of a peft LoRA model converts --to peft or --to hf (merged); for a "
                       "toolkit LoRA run convert it --to peft first, then that adapter directory --to zero|megatron")


def inspect_located(found, hf_config: str | None = None) -> dict:
    return inspect_peft_dcp(found.path, dcp_hf_config(found.path, hf_config))


def inspect_peft_dcp(path: Path, hf_config: dict) -> dict:
    source = PeftBaseSource(Path(path), hf_config)
    try:
        config_path = _config_path(Path(path))
        config = json.loads(config_path.read_text()) if config_path else {}
        shapes = lora_shapes(source)
        return {"path": str(path), "format": source.format, "family": source.model_type, "step": source.step,
                "rank": config.get("r", shapes["ranks"]), "alpha": config.get("lora_alpha"),
                "targets": config.get("target_modules", shapes["targets"]), "adapted_layers": shapes["adapted_layers"],
                "adapter_config": str(config_path) if config_path else None,
                "base_parameters": source.num_params(), "optimizer_state": source.has_optimizer,
                "converts": "--to peft | --to hf (merged onto the DCP's own base weights)"
                            + ("" if config_path else f"; needs {PEFT_CONFIG} beside it")}
    finally:
        source.close()


def dcp_hf_config(path: Path, hf_config: str | None) -> dict:
    """The base's HF config: ``--hf-config``, else config.json beside the DCP, else the one in the
    adapter_config.json's ``base_model_name_or_path`` (a local HF directory)."""
    from toolkit.formats.detect import _config_near, _explicit_config
    explicit = _explicit_config(hf_config)
    if explicit is not None:
        return explicit
    config_path = _config_path(Path(path))
    named = json.loads(config_path.read_text()).get("base_model_name_or_path") if config_path else None
    if named and (Path(named) / "config.json").is_file():
        try:
            return _config_near(Path(path))
        except ConvertError:
            return json.loads((Path(named) / "config.json").read_text())
    return _config_near(Path(path))

"""A 4-bit base under LoRA adapters (``model.quantize``: QLoRA), as transformers' ``BitsAndBytesConfig``
defines it: which layers are quantized, with which settings, and what a run refuses before it starts.

The quantized layers are the ones transformers would quantize, by transformers' own rule: every
``type(m) is nn.Linear`` outside ``get_keys_to_not_convert`` (the output embedding, tied weights, the
last parameter) and the model's ``_keep_in_fp32_modules``. Embeddings, the LM head and norms are never
``nn.Linear`` or are kept, so they stay in the model dtype. The quantization constants (blocksize 64,
double quantization optional) and the storage dtype (= the model dtype, which DeepSpeed can partition
and never value-casts: ``adapters/deepspeed/quant.py``) are bitsandbytes' and transformers' defaults.

Nothing here imports bitsandbytes but ``dense`` and ``round_trip`` (the launcher checks a config without it);
``adapters/deepspeed/quant.py`` builds and trains the model. The readers of a 4-bit parameter at the end
serve the exports (``adapters/export.py``) and the replica checksum.
"""
from __future__ import annotations

import torch

from toolkit.config import ConfigError, RunConfig

BLOCKSIZE = 64
"""Elements per absmax block (bitsandbytes' default; transformers exposes no other)."""
BNB_CONFIG_FILE = "bnb_config.json"
"""Beside a QLoRA run's ``adapter/``: the ``BitsAndBytesConfig`` (``BitsAndBytesConfig.from_dict``) of its base."""
DTYPES_BY_DEVICE = {"cpu": ("fp32", "bf16"), "cuda": ("fp32", "bf16", "fp16")}
"""model.dtype a 4-bit base runs in, per device type, for both nf4 and fp4. bitsandbytes 0.50 runs every
(quant type, dtype) pair on either device; DeepSpeed's CPU accelerator has no fp16 (measured, issue #43)."""


def stored_bytes_per_weight(cfg: RunConfig) -> tuple[float, float]:
    """(packed, constants) bytes per quantized weight: 4 bits, and the absmax per 64-block (fp32; with
    double quantization one byte, plus an fp32 absmax per 256 of those); the code tables are per tensor."""
    return 0.5, (1 / BLOCKSIZE + 4 / (BLOCKSIZE * 256)) if cfg.model.quantize_double else 4 / BLOCKSIZE


def quantized(cfg: RunConfig) -> bool:
    return cfg.model.quantize != "none"


def bnb_config(cfg: RunConfig):
    """transformers' ``BitsAndBytesConfig`` of this run: what quantizes the same base for peft users."""
    from transformers import BitsAndBytesConfig

    from toolkit.engine import DTYPES
    dtype = DTYPES[cfg.model.dtype]
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=cfg.model.quantize,
                              bnb_4bit_use_double_quant=cfg.model.quantize_double,
                              bnb_4bit_compute_dtype=dtype, bnb_4bit_quant_storage=dtype)


def record(cfg: RunConfig) -> dict | None:
    """What meta.json records of the base's quantization (None: not quantized); a resume compares it."""
    if not quantized(cfg):
        return None
    return {"method": "bitsandbytes", "quant_type": cfg.model.quantize, "double_quant": cfg.model.quantize_double,
            "blocksize": BLOCKSIZE, "storage_dtype": cfg.model.dtype, "compute_dtype": cfg.model.dtype}


def kept_modules(model: torch.nn.Module) -> list[str]:
    """Module names transformers never quantizes in ``model`` (its ``modules_to_not_convert``)."""
    from transformers.quantizers.base import HfQuantizer
    return HfQuantizer.get_modules_to_not_convert(model, None, getattr(model, "_keep_in_fp32_modules", None))


def quantized_modules(model: torch.nn.Module) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` that a 4-bit base holds in 4 bits."""
    from transformers.quantizers.quantizers_utils import should_convert_module
    kept = kept_modules(model)
    return [name for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and should_convert_module(name, kept)]


def check_quantize(cfg: RunConfig, hf_config, device_type: str) -> None:
    """Refuse, before any rank starts, a 4-bit base this toolkit cannot train exactly: no LoRA (the base
    is frozen), megatron, a model without a family table (its weights are read by name, one layer at a
    time), GPT-2-style Conv1D layers, a trained copy of a quantized layer, a shape bitsandbytes cannot
    pack, an unsupported dtype, parameter offload (untested with packed weights)."""
    from toolkit.families import find_family
    from toolkit.families.meta import meta_model
    key = f"model.quantize={cfg.model.quantize}"
    if cfg.backend == "megatron":
        raise ConfigError(f"{key} needs backend=deepspeed: no megatron-core path quantizes its linear layers "
                          "(bitsandbytes' Linear4bit is an HF module); set backend=deepspeed, or model.quantize=none "
                          "for LoRA on megatron")
    if not cfg.lora.enabled:
        raise ConfigError(f"{key} freezes the base in 4 bits and trains LoRA adapters only, but lora.rank=0; set "
                          "lora.rank > 0 (e.g. --set lora.rank=16), or model.quantize=none")
    if cfg.zero.offload_params:
        raise ConfigError(f"{key} with zero.offload_params=true is not supported yet (DeepSpeed would offload the "
                          "packed 4-bit weights, untested); unset zero.offload_params")
    if cfg.model.dtype not in DTYPES_BY_DEVICE.get(device_type, ()):
        raise ConfigError(f"{key} with model.dtype={cfg.model.dtype} does not run on {device_type} (supported there: "
                          f"{', '.join(DTYPES_BY_DEVICE.get(device_type, ()))}); set model.dtype=bf16 or fp32")
    if find_family(hf_config.model_type) is None:
        raise ConfigError(f"{key}: model_type {hf_config.model_type!r} has no family table in the toolkit, which "
                          "reads and quantizes a base one layer at a time by its checkpoint names; use a supported "
                          "family (toolkit/families) or model.quantize=none")
    model = meta_model(hf_config)
    from transformers.pytorch_utils import Conv1D
    conv = [n for n, m in model.named_modules() if isinstance(m, Conv1D)]
    if conv:
        raise ConfigError(f"{key}: {hf_config.model_type} has GPT-2-style Conv1D layers ({conv[0]}, ...), which the "
                          "toolkit does not quantize; use LoRA without it (model.quantize=none)")
    names = quantized_modules(model)
    if not names:
        raise ConfigError(f"{key}: {hf_config.model_type} has no linear layer transformers would quantize; "
                          "set model.quantize=none")
    saved = [s for s in cfg.lora.modules_to_save if any(n == s or n.endswith("." + s) for n in names)]
    if saved:
        raise ConfigError(f"lora.modules_to_save={saved}: a quantized layer cannot be trained in full (its "
                          f"weights are 4-bit under {key}); adapt it with lora.target_modules instead")
    itemsize = {"fp32": 4, "bf16": 2, "fp16": 2}[cfg.model.dtype]
    odd = [n for n in names if model.get_submodule(n).weight.numel() % (2 * itemsize)]
    if odd:
        raise ConfigError(f"{key}: {odd[0]} has {model.get_submodule(odd[0]).weight.numel()} weights, which do not "
                          f"pack into {cfg.model.dtype} storage (a multiple of {2 * itemsize} is needed); "
                          "set model.dtype=bf16 or model.quantize=none")


# --- reading a quantized parameter back ----------------------------------------------------------

def is_4bit(param) -> bool:
    return getattr(param, "quant_state", None) is not None and type(param).__name__ == "Params4bit"


def dense_shape(param) -> tuple[int, ...]:
    """The weight's shape as the model uses it ([out, in]; the packed storage is [n, 1])."""
    return tuple(param.quant_state.shape) if is_4bit(param) else tuple(getattr(param, "ds_shape", param.shape))


def dense(param) -> torch.Tensor:
    """A 4-bit weight dequantized (bitsandbytes' own, the values the forward multiplies with, in the model
    dtype); any other parameter as it is. A ZeRO-3 parameter must be gathered."""
    if not is_4bit(param):
        return param.detach()
    import bitsandbytes.functional as F
    return F.dequantize_4bit(param.data, param.quant_state)


def round_trip(weight: torch.Tensor, quantization: dict) -> torch.Tensor:
    """A full-precision weight as a run with meta.json's ``quantization`` record multiplied with it:
    cast to the storage dtype, quantized by bitsandbytes as the run's build does
    (``adapters/deepspeed/quant.py``), dequantized. CPU quantization is deterministic (issue #43)."""
    import bitsandbytes as bnb

    from toolkit.engine import DTYPES
    dtype = DTYPES[quantization["storage_dtype"]]
    packed = bnb.nn.Params4bit(weight.to(dtype), requires_grad=False, blocksize=quantization["blocksize"],
                               compress_statistics=quantization["double_quant"],
                               quant_type=quantization["quant_type"], quant_storage=dtype).to("cpu")
    return dense(packed)


def checksum_view(param) -> torch.Tensor:
    """What a replica checksum sums: a 4-bit weight's bytes as integers (its storage holds NaN bit
    patterns: a float sum is NaN, and NaN != NaN fails a comparison of equal replicas)."""
    if not is_4bit(param):
        return param.detach()
    data = param.detach()
    return data.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[data.element_size()])

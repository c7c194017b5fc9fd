"""Building an HF model under DeepSpeed's ZeRO-3 (``zero.Init``): the right dtype, HF's RoPE buffers, and
each rank's partitions filled from the checkpoint."""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from toolkit.plan import Plan


@contextlib.contextmanager
def zero_init(ds_config: dict, dtype: torch.dtype):
    """DeepSpeed's ``zero.Init`` making parameters of ``dtype``, with RoPE buffers as HF makes them.

    The dtype comes from the config (its bf16/fp16 sections say the run's dtype), not ``dtype=``:
    DeepSpeed 0.19.8 ``partition_parameters.py`` ``Init._set_dtype`` reads an explicit dtype as
    ``dtype or torch.float16 if is_fp16_supported() else torch.bfloat16 if is_bf16_supported else
    torch.float32``, which on an accelerator without fp16 (the CPU one) ignores ``dtype`` and gives
    bfloat16: an fp32 ZeRO-3 run on CPU got bf16 parameters (fp32 masters) and bf16 RoPE buffers.
    ``zero.Init`` also casts every float tensor made inside it, ``torch.arange`` included, so RoPE's
    ``inv_freq`` (fp32 in HF, whatever the weights' dtype) would be rounded to a bf16/fp16 run's
    dtype; transformers' ``prevent_arange_dtype_change`` (entered first, as its own ZeRO-3 loads
    do) keeps it fp32."""
    import deepspeed
    from transformers.integrations.deepspeed import prevent_arange_dtype_change
    init = deepspeed.zero.Init(config_dict_or_path=ds_config)
    if init.dtype != dtype:
        raise RuntimeError(f"DeepSpeed's zero.Init would build {init.dtype} parameters for a {dtype} run: the "
                           f"DeepSpeed config's bf16/fp16 sections must say model.dtype")
    with prevent_arange_dtype_change(), init:
        yield


def hf_zero3_load(plan: "Plan", ds_config: dict, dtype: torch.dtype) -> torch.nn.Module:
    """transformers' own ZeRO-3 load (its checkpoint conversions; rank 0 reads, ranks keep shares)."""
    from transformers.integrations import HfDeepSpeedConfig

    from toolkit.adapters.hf import model_dir
    from toolkit.families.meta import auto_class
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 (while it lives, from_pretrained builds under zero.Init)
    return auto_class(plan.model.hf_config()).from_pretrained(
        model_dir(plan.config.model.name_or_path), dtype=dtype, trust_remote_code=plan.config.model.trust_remote_code)


def fill_partitions(model: torch.nn.Module, source, plan: "Plan") -> None:
    """Each ZeRO-3 partition from the checkpoint: this rank reads only its elements of each tensor
    (DeepSpeed partitions a parameter's flattened elements, padded, in rank order)."""
    from toolkit.adapters.hf import checkpoint_pieces, page_returner, read_elements
    pieces, give_back = checkpoint_pieces(model, plan, source), page_returner(source)
    with torch.no_grad():
        for name, param in model.named_parameters():
            part = param.ds_tensor
            start = dist.get_rank(group=param.ds_process_group) * part.ds_numel
            stop = min(param.ds_numel, start + part.ds_numel)
            if stop > start:
                part[:stop - start].copy_(read_elements(source, pieces[name], start, stop))
            give_back()

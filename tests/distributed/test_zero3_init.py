"""The ZeRO-3 model build (``adapters/deepspeed/zero3.py`` ``zero_init``): parameters in the run's dtype
and RoPE buffers as HF builds them, on this (CPU) accelerator too. DeepSpeed's own ``zero.Init(dtype=
torch.float32)`` gives bfloat16 here (its ``_set_dtype``), which put an fp32 ZeRO-3 run's forward on
bf16 weights: a converted checkpoint resumed at stage 3 started 4.4e-5 (relative) off its loss."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ranks import run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")
DS = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}


def _built(rank, world):
    import deepspeed
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    from toolkit.adapters.deepspeed.zero3 import zero_init
    from toolkit.families.tiny import tiny_config
    deepspeed.init_distributed(dist_backend="gloo")
    out = {"hf": dict(AutoModelForCausalLM.from_config(tiny_config("llama")).named_buffers())}
    for name, dtype, ds in (("fp32", torch.float32, DS), ("bf16", torch.bfloat16, {**DS, "bf16": {"enabled": True}})):
        with zero_init(ds, dtype), no_init_weights():
            model = AutoModelForCausalLM.from_config(tiny_config("llama"), dtype=dtype)
        out[name] = {"params": {(p.dtype, p.ds_tensor.dtype) for p in model.parameters()},
                     "buffers": dict(model.named_buffers())}
    try:
        with zero_init(DS, torch.bfloat16):
            pass
    except RuntimeError as exc:
        out["mismatch"] = str(exc)
    return out


def test_zero3_build_keeps_dtype_and_rope_buffers(tmp_path):
    got = run_ranks(_built, 1, tmp_path)[0]
    assert got["fp32"]["params"] == {(torch.float32, torch.float32)}
    assert got["bf16"]["params"] == {(torch.bfloat16, torch.bfloat16)}
    for run in ("fp32", "bf16"):
        for name, ref in got["hf"].items():  # RoPE's inv_freq: fp32 and bit-equal to HF's, in both runs
            assert got[run]["buffers"][name].dtype == ref.dtype == torch.float32, (run, name)
            assert torch.equal(got[run]["buffers"][name], ref), (run, name)
    assert "must say model.dtype" in got["mismatch"]

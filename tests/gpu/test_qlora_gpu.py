"""QLoRA on the device (``pytest -m gpu``; ``TOOLKIT_GPU_TESTS_ON_CPU=1`` rehearses it on the CPU in fp32):
a real layer's shape (4096 x 11008) in NF4 with double quantization, bf16 on the GPU.

- the device's ``quantize_4bit`` against the CPU op on the same tensor: packed bytes and absmax (whether
  ``toolkit convert`` may re-quantize on the CPU a base that trained on the GPU: the count of differing
  blocks is recorded);
- ``Linear4bit`` forward and backward through bitsandbytes' device kernel against dequantize, then
  ``F.linear`` in fp32 (bf16 tolerance);
- ``toolkit train`` of the demo base with ``model.quantize=nf4`` and LoRA: finite, falling losses.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from tests.helpers.gpu import DEVICE, DTYPE, GPU_ONLY, records, toolkit_train
from tests.helpers.measure import measure

pytestmark = GPU_ONLY

OUT, IN = 4096, 11008
MATMUL_RTOL = 2e-2
"""Forward and input gradient through the 4-bit kernel vs dequantize + fp32 matmul, max |diff| / max |ref|:
bf16 inputs and outputs (8 bits of mantissa over an 11008-long dot product). Exact in the fp32 rehearsal."""


def _dtype() -> torch.dtype:
    return torch.bfloat16 if DTYPE == "bf16" else torch.float32


def test_device_quantization_and_4bit_matmul_against_dequantized_fp32():
    import bitsandbytes as bnb
    import bitsandbytes.functional as bf
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(OUT, IN, generator=g) * 0.02).to(_dtype())
    packed, state = bf.quantize_4bit(weight.to(DEVICE), blocksize=64, compress_statistics=True, quant_type="nf4",
                                     quant_storage=_dtype())
    cpu_packed, cpu_state = bf.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4",
                                             quant_storage=_dtype())
    bytes_ = packed.cpu().view(torch.uint8).view(-1, 32)  # 32 bytes: one 64-element block
    differing = int((bytes_ != cpu_packed.view(torch.uint8).view(-1, 32)).any(dim=1).sum())
    measure("blocks whose packed bytes differ, device vs CPU quantize", differing)
    measure("absmax equal, device vs CPU", bool(torch.equal(state.absmax.cpu(), cpu_state.absmax)))

    layer = bnb.nn.Linear4bit(IN, OUT, bias=False, compute_dtype=_dtype(), quant_type="nf4", quant_storage=_dtype())
    layer.weight = bnb.nn.Params4bit(weight, requires_grad=False, quant_type="nf4", quant_storage=_dtype(),
                                     module=layer).to(DEVICE)
    layer.support_avx512bf16_for_cpu = False
    x = torch.randn(4, 64, IN, generator=g).to(DEVICE, _dtype()).requires_grad_()
    out = layer(x)
    out.float().square().sum().backward()
    dense = bf.dequantize_4bit(layer.weight.data, layer.weight.quant_state).float()
    x32 = x.detach().float().requires_grad_()
    ref = F.linear(x32, dense)
    ref.square().sum().backward()
    fwd = ((out.float() - ref).abs().max() / ref.abs().max()).item()
    grad = ((x.grad.float() - x32.grad).abs().max() / x32.grad.abs().max()).item()
    measure("forward max |4-bit kernel - dequantized fp32| / max", fwd, MATMUL_RTOL)
    measure("input grad max |4-bit kernel - dequantized fp32| / max", grad, MATMUL_RTOL)
    assert fwd <= MATMUL_RTOL and grad <= MATMUL_RTOL


def test_qlora_trains_through_toolkit_train(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.config import DEMO_DIR
    torch.manual_seed(0)
    base = tmp_path / "base"
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_DIR / "tiny-llama")).save_pretrained(base)
    run = tmp_path / "run"
    toolkit_train(run, f"model.name_or_path={base}", "model.init=pretrained", f"model.dtype={DTYPE}",
                  "model.quantize=nf4", "lora.rank=8", "train.steps=8", "train.lr=3e-3", "zero.stage=2")
    losses = [r["loss"] for _, r in sorted(records(run).items())]
    measure("QLoRA losses", losses)
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert (run / "adapter" / "bnb_config.json").is_file()

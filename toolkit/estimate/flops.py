"""Model FLOPs utilisation: one formula, one table of peaks.

Model FLOPs per token (PaLM, appendix B; forward + backward, no recomputation counted):

    6 * N + 12 * n_layers * attention_width * seq_len

N counts every parameter except the input embedding (a lookup does no matmul; an untied or tied
LM head does, and is counted once); of a mixture of experts' routed experts, only the k of E a
token is routed to. ``attention_width`` is heads x head_dim. The second term is
the attention score and value matmuls over the full sequence (causal masking not discounted, as in
PaLM and Megatron-LM's reporting).

MFU = tokens/s per device x FLOPs per token / the device's dense peak for the training dtype.
Peaks are dense (no 2:4 sparsity) vendor figures for the SXM parts; fp32 training on NVIDIA runs
matmuls in TF32 (``model.tf32``, on by default), so fp32 uses the TF32 peak, and the plain fp32
peak when TF32 is off. On CPU there is no meaningful peak: MFU is absent.
"""
from __future__ import annotations

# Dense TFLOP/s by device name fragment and training dtype (NVIDIA data sheets, SXM).
# "fp32" is the TF32 tensor-core peak (fp32 training with model.tf32, the default); "fp32_ieee" the
# plain fp32 peak, for runs with model.tf32=false.
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5, "fp32_ieee": 67.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "fp32": 494.5, "fp32_ieee": 67.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 156.0, "fp32_ieee": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "fp32": 183.0, "fp32_ieee": 91.6},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 35.0, "fp32_ieee": 31.2},
}


def flops_per_token(spec, seq_len: int) -> float:
    """Model FLOPs per trained token of a model (``plan.ModelSpec``; see the module docstring)."""
    matmul_params = spec.total - spec.embedding + (spec.embedding if spec.tied else 0)
    if spec.experts:  # a token runs through k of the E routed experts
        matmul_params -= sum(spec.per_layer_experts) * (1 - spec.experts_per_token / spec.experts)
    return 6 * matmul_params + 12 * spec.layers * spec.heads * spec.head_dim * seq_len


def peak_flops(dtype: str, device_name: str | None = None, tf32: bool = True) -> float | None:
    """Dense peak FLOP/s of this process's GPU for ``dtype`` (fp32: the TF32 peak unless ``tf32``
    is off); None on CPU or an unknown device."""
    if device_name is None:
        import torch
        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    peaks = next((v for k, v in PEAK_TFLOPS.items() if k in device_name), None)
    key = "fp32_ieee" if dtype == "fp32" and not tf32 else dtype
    return peaks[key] * 1e12 if peaks else None


def mfu(tokens_per_s_per_device: float, fpt: float, peak: float | None) -> float | None:
    return tokens_per_s_per_device * fpt / peak if peak else None

"""bf16 sequence tiles against fp32 (``zero.tiled_loss``, ``zero.tiled_mlp``): the relative error of each
weight gradient summed over many tiles, beside the untiled bf16 gradient's, both against the fp32
untiled gradient. Shared by the unit tests and the GPU layer (tests/gpu/test_features_gpu.py)."""
from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F

TILES = 64
"""A 128k vocabulary and 32k tokens per rank give ~63 loss tiles (``loss.loss_chunk_rows``)."""
BF16_BOUND = 1.5
"""Tiled bf16 gradient error over the untiled bf16 one. Measured at 64 tiles on the CPU: lm_head 1.19,
MLP weights 1.05; with a bf16 running sum over the tiles (the toolkit's lm_head until 2026-12, and
DeepSpeed's TiledMLP) 3.96 and 2.07."""


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def lm_head_errors(device: str = "cpu") -> dict[str, float]:
    """bf16 hidden states through a bf16 lm_head (no bias) in ``TILES`` loss tiles and untiled: each
    head gradient's error against the fp32 untiled one."""
    from toolkit.loss import tiled_token_loss_sum
    g = torch.Generator().manual_seed(0)
    n, h, v = 64 * TILES, 64, 1024
    hidden, labels = torch.randn(n, h, generator=g).to(device), torch.randint(0, v, (n,), generator=g).to(device)
    head = torch.nn.Linear(h, v, bias=False, device=device)
    with torch.no_grad():
        head.weight.copy_(torch.randn(v, h, generator=g) * 0.1)
    F.cross_entropy(head(hidden), labels, reduction="sum").backward()
    reference, head = head.weight.grad.clone(), head.bfloat16()
    head.weight.grad = None
    F.cross_entropy(head(hidden.bfloat16()).float(), labels, reduction="sum").backward()
    untiled = rel(head.weight.grad, reference)
    head.weight.grad = None
    loss, _ = tiled_token_loss_sum(hidden.bfloat16()[None], head, labels[None], rows=n // TILES)
    loss.backward()
    return {"tiled": rel(head.weight.grad, reference), "untiled": untiled}


def mlp_errors(device: str = "cpu") -> dict:
    """A bf16 LlamaMLP over ``TILES`` tiles (``adapters/deepspeed/tiles.py``) and untiled: each weight gradient's
    error against the fp32 untiled one, and how many times the tiled MLP ran a tile (forward and
    recompute: 2 x TILES)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    from toolkit.adapters.deepspeed import tiles
    g = torch.Generator().manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=256, hidden_act="silu")
    x, upstream = (torch.randn(2, 2048, 64, generator=g).to(device) for _ in range(2))
    mlp = LlamaMLP(config).to(device)
    mlp(x).backward(upstream)
    reference = {n: p.grad.clone() for n, p in mlp.named_parameters()}
    out, calls = {}, []
    for tiled in (False, True):
        model = torch.nn.Module()  # the shape tile_mlps looks for: a config and modules named *.mlp
        model.config, model.model = config, torch.nn.Module()
        model.model.mlp = LlamaMLP(config).to(device, torch.bfloat16)
        model.model.mlp.load_state_dict(mlp.state_dict())
        with mock.patch.object(tiles, "mlp_tiles", lambda seq, hidden: TILES), \
                mock.patch.object(tiles, "_mlp", lambda self, t, f=tiles._mlp: calls.append(1) or f(self, t)):
            if tiled:
                tiles.tile_mlps(model)
            model.model.mlp(x.bfloat16()).backward(upstream.bfloat16())
        out["tiled" if tiled else "untiled"] = {n: rel(p.grad, reference[n]) for n, p in model.model.mlp.named_parameters()}
    out["tile_calls"] = len(calls)
    return out

"""Sequence tiles on the HF path (``zero.tiled_mlp``, ``zero.tiled_loss``), as ALST does: the parts of a
step whose activations grow with tokens x a wide dimension (the MLP's intermediate, the vocabulary)
computed a tile of the sequence at a time, so a rank's peak does not grow with the whole sequence.

The MLP goes through ``TiledMLP``, DeepSpeed's ``TiledMLP`` (``deepspeed.runtime.sequence_parallel.
ulysses_sp``) with the weight gradients summed over the tiles in fp32 (``loss.TileGrads``; DeepSpeed's
accumulates them into ``.grad`` in the weights' dtype, a bf16 rounding per tile, and has no option
against it): its forward runs each tile without grad and keeps only the MLP's input; its backward
recomputes each tile with grad. The tile count is ALST's rule, ceil(seq / hidden), the same on every
rank, so ZeRO-3's parameter gathering in each tile's recompute happens as often on every rank.
The loss side (``HiddenStates`` + ``loss.tiled_token_loss_sum``) takes the decoder's last hidden
states instead of the logits and runs the lm_head per tile.
"""
from __future__ import annotations

import types

import torch

from toolkit.adapters import moe
from toolkit.loss import TileGrads, mlp_tiles

_MLP_PARTS = ("gate_proj", "up_proj", "down_proj", "act_fn")


def tile_mlps(model: torch.nn.Module) -> int:
    """Route every decoder layer's MLP through ``TiledMLP``; the number of MLPs tiled. Before
    ``deepspeed.initialize`` (the instance's forward is replaced; ZeRO's hooks stay on the modules)."""
    config = model.config
    if moe.is_router_model(config):
        raise ValueError(f"zero.tiled_mlp=true tiles dense gate/up/down MLPs, but {config.model_type} is a "
                         "mixture-of-experts model (its experts take routed tokens); set zero.tiled_mlp=false")
    mlps = [m for name, m in model.named_modules() if name.endswith(".mlp")]
    plain = [m for m in mlps if all(hasattr(m, part) for part in _MLP_PARTS)]
    if not mlps or len(plain) != len(mlps):
        raise ValueError(f"zero.tiled_mlp=true needs MLPs of gate_proj/up_proj/down_proj/act_fn (LlamaMLP's "
                         f"form), but {config.model_type} has {len(mlps) - len(plain)} of {len(mlps)} other; "
                         "set zero.tiled_mlp=false")
    for mlp in plain:
        mlp.forward = types.MethodType(_tiled_forward, mlp)
    return len(plain)


def _mlp(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _tiled_forward(self, x: torch.Tensor) -> torch.Tensor:
    tiles = mlp_tiles(x.shape[-2], x.shape[-1])
    if tiles == 1:
        return _mlp(self, x)
    params = [p for p in self.parameters() if p.requires_grad]
    partitioned = any(hasattr(p, "ds_tensor") for p in params)  # ZeRO-3: whole only inside each part's call
    return TiledMLP.apply(self, x, tiles, partitioned, *([] if partitioned else params))


class TiledMLP(torch.autograd.Function):
    """``_mlp`` of ``[..., tokens, hidden]`` a tile of tokens at a time (DeepSpeed's ``TiledMLP``: the
    tokens of every row flattened and cut into ``tiles`` pieces). The forward keeps only the input;
    the backward recomputes each tile with grad and sums the weight gradients over the tiles in fp32
    (``TileGrads``). Whole weights are inputs here and get the sum returned; ZeRO-3's partitioned ones
    get it through the last tile's backward."""

    @staticmethod
    def forward(ctx, mlp: torch.nn.Module, x: torch.Tensor, tiles: int, partitioned: bool,
                *params: torch.Tensor) -> torch.Tensor:
        ctx.mlp, ctx.tiles, ctx.partitioned = mlp, tiles, partitioned
        ctx.save_for_backward(x)
        with torch.no_grad():
            flat = x.reshape(-1, x.shape[-1])
            return torch.cat([_mlp(mlp, part) for part in flat.chunk(tiles)]).view(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        params = [p for p in ctx.mlp.parameters() if p.requires_grad]
        sums = TileGrads(params, partitioned=ctx.partitioned)
        flat, grad_flat = x.detach().reshape(-1, x.shape[-1]), grad_out.reshape(-1, x.shape[-1])
        grad_x = torch.empty_like(flat)
        parts = list(zip(flat.chunk(ctx.tiles), grad_flat.chunk(ctx.tiles), grad_x.chunk(ctx.tiles)))
        for i, (part, grad_part, into) in enumerate(parts):
            part = part.detach().requires_grad_(True)
            with torch.enable_grad():
                out = _mlp(ctx.mlp, part)
                into.copy_(sums.tile(out, grad_part, part, last=i == len(parts) - 1))
            del out
        return None, grad_x.view(x.shape), None, None, *sums.result()


class HiddenStates:
    """The decoder's last hidden states of the next forward, caught by a hook on the decoder (the HF
    CausalLM's ``model``), for a loss that runs the lm_head itself. The forward then asks for one
    position's logits (``logits_to_keep=1``), so the whole [tokens, vocab] never exists."""

    def __init__(self, model: torch.nn.Module):
        self.head = model.get_output_embeddings()
        embedding = model.get_input_embeddings().weight
        self.tied = tuple(p for p in self.head.parameters() if p is embedding)
        self.value = None
        model.get_decoder().register_forward_hook(self._keep)

    def _keep(self, module, args, output):
        self.value = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]

    def take(self) -> torch.Tensor:
        value, self.value = self.value, None
        if value is None:
            raise RuntimeError("zero.tiled_loss: the decoder's forward hook saw no forward")
        return value

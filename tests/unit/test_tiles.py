"""Sequence tiles (``zero.tiled_mlp``, ``zero.tiled_loss``; ``toolkit/adapters/deepspeed/tiles.py``,
``loss.tiled_token_loss_sum``): the loss and every fp32 gradient equal HF's own untiled forward and
backward (its logits, ``F.cross_entropy`` summed) on tiny llama and qwen2 (attention biases), with
tiles that do not divide the sequence; and the refusals."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.tiles import BF16_BOUND, TILES, lm_head_errors, mlp_errors
from toolkit.adapters.deepspeed.tiles import HiddenStates, tile_mlps
from toolkit.config import validate
from toolkit.families.tiny import tiny_model
from toolkit.loss import IGNORE_INDEX, tiled_token_loss_sum


def _batch(vocab: int, batch: int = 2, seq: int = 40):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[:, :5] = IGNORE_INDEX
    return ids, labels


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _tokens_seen(model) -> dict[str, list[int]]:
    """Tokens per call of every MLP's gate_proj (``mlp``) and of the lm_head (``head``), in call order."""
    seen = {"mlp": [], "head": []}

    def count(kind):
        return lambda module, args, output: seen[kind].append(args[0].shape[:-1].numel())
    for layer in model.model.layers:
        layer.mlp.gate_proj.register_forward_hook(count("mlp"))
    model.get_output_embeddings().register_forward_hook(count("head"))
    return seen


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_tiled_mlp_and_loss_equal_hf_untiled(family):
    ref = tiny_model(family, seed=0, num_hidden_layers=2, hidden_size=16, intermediate_size=48)
    ids, labels = _batch(ref.config.vocab_size)
    loss = F.cross_entropy(ref(input_ids=ids).logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    loss.backward()
    want = _grads(ref)

    model = tiny_model(family, seed=0, num_hidden_layers=2, hidden_size=16, intermediate_size=48)
    assert tile_mlps(model) == 2  # seq 40 over hidden 16: 3 tiles, the last shorter
    tokens = _tokens_seen(model)
    hidden = HiddenStates(model)
    out = model(input_ids=ids, logits_to_keep=1)
    assert out.logits.shape[1] == 1
    got_loss, valid = tiled_token_loss_sum(hidden.take(), model.get_output_embeddings(), labels, rows=24)
    forward = {k: v[:] for k, v in tokens.items()}
    got_loss.backward()
    backward = {k: v[len(forward[k]):] for k, v in tokens.items()}
    got = _grads(model)
    # tiled it was: each layer's MLP saw the 80 tokens 3 tiles at a time, forward and in the backward's
    # recompute; the lm_head one position per row (logits_to_keep), then 24 tokens at a time, both ways
    for seen in (forward["mlp"], backward["mlp"]):
        assert len(seen) == 2 * 3 and max(seen) < 80 and sum(seen) == 2 * 80, seen
    assert forward["head"][0] == 2 and forward["head"][1:] == backward["head"] == [24, 24, 24, 8], tokens
    assert int(valid) == int((labels != IGNORE_INDEX).sum())
    torch.testing.assert_close(got_loss, loss, rtol=1e-6, atol=0)
    assert got.keys() == want.keys()
    for name, g in want.items():
        rel = ((got[name] - g).norm() / g.norm()).item()
        assert rel < 1e-5, f"{name}: relative error {rel:.2e}"


def test_refusals():
    with pytest.raises(ValueError, match="zero.tiled_mlp=true .* mixture-of-experts"):
        tile_mlps(tiny_model("mixtral", seed=0))
    with pytest.raises(ValueError, match=r"zero.tiled_mlp=true needs MLPs of gate_proj/up_proj/down_proj/act_fn "
                                         r"\(LlamaMLP's form\), but gpt2 has 4 of 4 other; set zero.tiled_mlp=false"):
        tile_mlps(tiny_model("gpt2", seed=0))  # c_fc / c_proj
    with pytest.raises(ValueError, match="zero.tiled_loss=true .* train.objective=dpo"):
        validate({"zero": {"tiled_loss": True}, "train": {"objective": "dpo"},
                  "data": {"template": "preference"}})
    with pytest.raises(ValueError, match="zero.tiled_mlp tile the HF model on DeepSpeed, but backend=megatron"):
        validate({"zero": {"tiled_mlp": True}, "backend": "megatron"})



def test_bf16_lm_head_gradient_summed_over_tiles_in_fp32():
    """bf16 hidden states and lm_head, 64 loss tiles: the head's weight gradient is as close to the
    fp32 untiled one as the untiled bf16 gradient is (``loss.TileGrads``; a bf16 running sum: 4x)."""
    errors = lm_head_errors()
    print(f"\nlm_head gradient vs fp32: {TILES} tiles bf16 {errors['tiled']:.2e}, untiled bf16 {errors['untiled']:.2e}")
    assert errors["tiled"] < BF16_BOUND * errors["untiled"]


def test_bf16_mlp_gradients_summed_over_tiles_in_fp32():
    """A bf16 LlamaMLP over 64 tiles (``zero.tiled_mlp``): every weight gradient as close to fp32
    untiled as the untiled bf16 one (DeepSpeed's TiledMLP: 2x), and the tiles ran."""
    errors = mlp_errors()
    print("\n" + "; ".join(f"{n}: {e:.2e} tiled vs {errors['untiled'][n]:.2e}" for n, e in errors["tiled"].items()))
    assert errors["tile_calls"] == 2 * TILES
    for name, error in errors["tiled"].items():
        assert error < BF16_BOUND * errors["untiled"][name], name

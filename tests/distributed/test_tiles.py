"""``zero.tiled_mlp`` and ``zero.tiled_loss`` through the DeepSpeed engine at ``zero.sp=2`` (2 gloo ranks,
dp 1) against HF's own untiled model in one process (``tests/helpers/ulysses.py``'s reference: each
document alone): the step's loss, grad norm and every parameter's whole gradient. The tile sizes
are forced small (3 MLP tiles, loss tiles of 6 tokens: neither divides a rank's 16 tokens) so the
tiny models tile at all; the rules that pick them in a real run are ``tiles.mlp_tiles`` and
``loss.loss_chunk_rows``.

- llama (tied embeddings: the lm_head's tiled gradient adds to the embedding's), ZeRO-2;
- qwen2 (attention biases, untied), ZeRO-3 with activation checkpointing: the MLP and lm_head
  weights gathered again inside each tile's recompute;
- llama tied, ZeRO-3: the partitioned head's tile gradients and the embedding's reduced together;
- llama with one KV head, ZeRO-1.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.ulysses import GRAD_RTOL, LOSS_RTOL, grad_ratios, hf_reference, observed_step, rows, sp_engine
from tests.helpers.zoo import save_base

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

CASES = {  # name: (zoo variant, ZeRO stage, activation checkpointing)
    "llama": ("llama-tied-llama3", 2, False),
    "qwen2": ("qwen2-untied-linear", 3, True),
    "llama_zero3": ("llama-tied-llama3", 3, False),
    "llama_mqa_zero1": ("llama-mqa-linear-hd", 1, False),
}


def _rank(rank, world, bases):
    from toolkit import loss
    from toolkit.adapters.deepspeed import tiles
    from toolkit.loss import IGNORE_INDEX
    calls = []

    def three(seq, hidden):
        calls.append(seq)
        return 3
    tiles.mlp_tiles, loss.loss_chunk_rows = three, lambda vocab: 6
    out = {}
    for name, (variant, stage, ckpt) in CASES.items():
        micro = rows("documents")
        tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
        _, engine = sp_engine(bases[variant], world, stage, "documents", ckpt,
                              zero={"stage": stage, "sp": 2, "tiled_mlp": True, "tiled_loss": True})
        stats, logits, grads = observed_step(engine, micro, tokens)
        out[name] = {"loss": stats.loss, "grad_norm": stats.grad_norm, "grads": grads,
                     "logit_positions": {x.shape[1] for x in logits}, "mlp_calls": len(calls)}
        calls.clear()
        engine.engine.destroy()
    return out


@pytest.fixture(scope="module")
def tiled_runs(tmp_path_factory):
    from tests.helpers.ranks import run_ranks
    root = tmp_path_factory.mktemp("tiles")
    bases = {v: save_base(v, root / "bases") for v, *_ in CASES.values()}
    return run_ranks(_rank, 2, tmp_path_factory.mktemp("tiles_ranks"), bases, timeout=600), bases


@pytest.mark.parametrize("case", sorted(CASES))
def test_tiled_sp2_equals_hf_untiled(tiled_runs, case):
    from transformers import AutoModelForCausalLM
    ranks, bases = tiled_runs
    got = [r[case] for r in ranks]
    model = AutoModelForCausalLM.from_pretrained(bases[CASES[case][0]], dtype=torch.float32,
                                                 attn_implementation="eager")
    ref = hf_reference(model, rows("documents"))
    assert got[0]["logit_positions"] == {1}  # the whole logits never made
    assert got[0]["mlp_calls"] > 0
    ratios = grad_ratios(got[0]["grads"], ref["grads"])
    worst = max(ratios, key=ratios.get)
    print(f"\n{case}: loss {got[0]['loss']:.6f} vs {ref['loss']:.6f}, grad norm {got[0]['grad_norm']:.6f} vs "
          f"{ref['grad_norm']:.6f}, worst grad {ratios[worst]:.2e} ({worst})")
    for r in got:
        assert r["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
        assert r["grad_norm"] == pytest.approx(ref["grad_norm"], rel=LOSS_RTOL)
    assert ratios[worst] < GRAD_RTOL, worst

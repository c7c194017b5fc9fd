"""Megatron path vs HF's own model, per family and layout, on gloo: logits and per-parameter gradients.

Each layout is one spawned job (tp x pp ranks) that builds every family in turn from the same tiny
seeded HF model the test process builds, so ranks hold nothing but their own slices.
"""
from __future__ import annotations

import pytest
import torch

from tests.test_families import TINY, tiny_model
from tests.test_megatron_compat import run_ranks
from toolkit.config import validate
from toolkit.engine import IGNORE_INDEX, token_loss_sum

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo parity suite")

FAMILIES = sorted(TINY)
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]
EXTRA = {  # schedule / memory options that must not change the numbers: (tp, pp, megatron.* fields)
    "pp2_vpp2_full_recompute": (1, 2, {"vpp": 2, "recompute": "full"}),
    "tp2_selective_recompute": (2, 1, {"recompute": "selective"}),
    "pp2_uneven_1_3": (1, 2, {"first_stage_layers": 1}),
    "tp2_sequence_parallel": (2, 1, {"sequence_parallel": True}),  # norms' grads summed over TP
}
LOGIT_TOL = 2e-5  # float32 rounding of different matmul shapes and reduction orders
GRAD_TOL = 2e-5


def batches(vocab: int, n_micro: int = 2, mbs: int = 2, seq: int = 16, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro):
        ids = torch.randint(0, vocab, (mbs, seq), generator=g)
        labels = torch.randint(0, vocab, (mbs, seq), generator=g)
        labels[0, :3] = IGNORE_INDEX  # some positions carry no loss
        ids[:, 5] = 0  # the pad token of the llama-like configs: HF's padding_idx gets no lookup grad
        out.append({"input_ids": ids, "labels": labels})
    return out


def hf_reference(model, micro_batches):
    """HF logits per micro-batch and HF grads of sum(token losses) / valid tokens, single process."""
    model.zero_grad()
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    logits = []
    for mb in micro_batches:
        out = model(input_ids=mb["input_ids"]).logits
        loss, _ = token_loss_sum(out, mb["labels"])
        (loss / tokens).backward()
        logits.append(out.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return logits, grads, tokens


def run_config(tp: int, pp: int, **megatron):
    return validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp, **megatron},
                     "train": {"global_batch_size": 4, "micro_batch_size": 2}})


def _rank_parity(rank, world, tp, pp, extra=None):
    from toolkit.adapters.megatron import MegatronEngine
    results = {}
    for family in FAMILIES:
        model = tiny_model(family)
        micro = batches(model.config.vocab_size)
        ref_logits, ref_grads, tokens = hf_reference(model, micro)
        engine = MegatronEngine(run_config(tp, pp, **(extra or {})), model.config, model.state_dict())
        got = engine.logits(micro)
        engine.forward_backward(micro, tokens)
        grads = engine.hf_state(attr="main_grad")
        if got is not None:
            results[family] = {"logits": max((a - b).abs().max().item() for a, b in zip(got, ref_logits))}
        if grads is not None:
            results.setdefault(family, {})["grads"] = {
                n: ((grads[n] - g).abs().max().item(), g.abs().max().item()) for n, g in ref_grads.items()}
            results[family]["missing_grads"] = sorted(set(ref_grads) - set(grads))
        del engine
    return results


def _run_layout(tmp_path_factory, name, tp, pp, extra=None):
    results = run_ranks(_rank_parity, tp * pp, tmp_path_factory.mktemp(name), tp, pp, extra, timeout=600)
    merged = {}
    for r in results:
        for fam, d in r.items():
            merged.setdefault(fam, {}).update(d)
    print(f"\n  {name}: " + ", ".join(f"{f} logits {d['logits']:.2e} grads "
                                      f"{max(x[0] for x in d['grads'].values()):.2e}" for f, d in sorted(merged.items())))
    return merged


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    print("\nmax |diff| HF vs megatron per family and layout:")
    return {(tp, pp): _run_layout(tmp_path_factory, f"tp{tp}_pp{pp}", tp, pp) for tp, pp in LAYOUTS}


@pytest.fixture(scope="module")
def parity_extra(tmp_path_factory):
    return {name: _run_layout(tmp_path_factory, name, tp, pp, extra) for name, (tp, pp, extra) in EXTRA.items()}


@pytest.mark.parametrize("name", sorted(EXTRA))
def test_layout_options_change_nothing(parity_extra, name):
    for family, d in parity_extra[name].items():
        assert d["logits"] < LOGIT_TOL, family
        assert d["missing_grads"] == []
        assert all(diff <= GRAD_TOL * max(scale, 1.0) for diff, scale in d["grads"].values()), family


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(parity, family, tp, pp):
    assert parity[(tp, pp)][family]["logits"] < LOGIT_TOL


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_hf_per_parameter(parity, family, tp, pp):
    assert parity[(tp, pp)][family]["missing_grads"] == []
    grads = parity[(tp, pp)][family]["grads"]
    bad = {n: d for n, (d, scale) in grads.items() if d > GRAD_TOL * max(scale, 1.0)}
    assert not bad, bad

"""Megatron path vs HF's own model, per family and layout, on gloo: logits and per-parameter gradients.

Two spawned jobs (2 ranks: every layout but TP2 x PP2, which gets 4; more ranks than cores only cost
spinning) build every family at every layout in turn (dp = world / (tp x pp), the global batch's
micro-batches split over the DP ranks, gradients all-reduced to compare whole) from the same tiny
seeded HF model the test process builds, so ranks hold nothing but their own slices.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.parity import (
    GRAD_RTOL,
    assert_logits_on_every_dp_rank,
    batches,
    grad_gap,
    grad_mismatches,
    hf_reference,
    logit_gaps,
    worst_ratio,
)
from tests.helpers.ranks import run_ranks
from toolkit.config import validate
from toolkit.families.tiny import TINY, tiny_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo parity suite")

FAMILIES = sorted(TINY)
LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]  # (tp, pp)
EXTRA = {  # schedule / memory options that must not change the numbers: (tp, pp, megatron.* fields)
    "pp2_vpp2_full_recompute": (1, 2, {"vpp": 2, "recompute": "full"}),
    "tp2_selective_recompute": (2, 1, {"recompute": "selective"}),
    "pp2_uneven_1_3": (1, 2, {"first_stage_layers": 1}),
    "tp2_sequence_parallel": (2, 1, {"sequence_parallel": True}),  # norms' grads summed over TP
    # megatron's own DotProductAttention and RoPE (every other layout runs the toolkit's attention)
    "pp2_local_attention": (1, 2, {"attention": "local"}),  # tp = 1
    "tp2_sp_local_attention": (2, 1, {"sequence_parallel": True, "attention": "local"}),
}


def run_config(tp: int, pp: int, **megatron):
    return validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp, **megatron},
                     "train": {"global_batch_size": 4, "micro_batch_size": 1}})


def _rank_parity(rank, world, layouts):
    """Each layout, and each of its families in turn on these ranks."""
    from tests.helpers.ranks import release_megatron
    results = {}
    for name, (tp, pp, extra, families) in layouts.items():
        for family in families:
            results[(name, family)] = _one_layout(family, tp, pp, extra)
            release_megatron()
    return results


def _one_layout(family, tp, pp, extra) -> dict:
    from tests.helpers.ranks import megatron_engine
    model = tiny_model(family)
    micro = batches(model.config.vocab_size)
    ref_logits, ref_grads, tokens = hf_reference(model, micro)
    engine = megatron_engine(run_config(tp, pp, **extra), model)
    dp = engine.dp_size
    mine = micro[engine.dp_rank::dp]
    got = engine.logits(mine)
    engine.forward_backward(mine, tokens, complete_grads=True)  # all-reduced: whole grads to compare
    grads = engine.hf_state(attr="main_grad")
    out = {"dp": dp, "logits": logit_gaps(engine, got, ref_logits)}
    if grads is not None:
        out["grads"] = {n: grad_gap(grads[n], g) for n, g in ref_grads.items()}
        out["missing_grads"] = sorted(set(ref_grads) - set(grads))
    return out


def merge_ranks(ranks: list[dict]) -> dict:
    """Per (layout, family): the logit gaps of every DP rank that holds logits, the rest from rank 0."""
    merged = {}
    for r in ranks:
        for key, d in r.items():
            m = merged.setdefault(key, {"logits": {}})
            m["logits"].update(d["logits"])
            m.update({k: v for k, v in d.items() if k != "logits"})
    return merged


LAYOUTS_BY_NAME = {f"tp{tp}_pp{pp}": (tp, pp, {}) for tp, pp in LAYOUTS} | EXTRA


def selected(request) -> dict[str, list[str]]:
    """layout name -> the families the selected tests of this module ask for there (``-k olmo2``
    builds olmo2 only)."""
    wanted: dict[str, set[str]] = {}
    for item in request.session.items:
        if item.module is not request.module or not hasattr(item, "callspec"):
            continue
        p = item.callspec.params
        wanted.setdefault(p.get("name") or f"tp{p['tp']}_pp{p['pp']}", set()).add(p["family"])
    return {name: sorted(families) for name, families in wanted.items()}


@pytest.fixture(scope="module")
def parity(request, tmp_path_factory):
    layouts = {name: (*LAYOUTS_BY_NAME[name], families) for name, families in selected(request).items()}
    jobs = {2: {n: x for n, x in layouts.items() if n != "tp2_pp2"},
            4: {n: x for n, x in layouts.items() if n == "tp2_pp2"}}
    ranks = [r for world, job in jobs.items() if job
             for r in run_ranks(_rank_parity, world, tmp_path_factory.mktemp(f"parity{world}"), job, timeout=1200)]
    merged = merge_ranks(ranks)
    print("\nHF vs megatron per family and layout: max |logit diff| per DP rank; worst gradient, relative "
          "to its own max |grad|:")
    for (name, family), d in merged.items():
        print(f"  {name} {family}: logits {d['logits']} grads {worst_ratio(d['grads'])}")
    return merged


def families_for(extra: dict) -> list[str]:
    """Megatron's local attention has no sliding window: families with one are refused there (test_plan)."""
    return [f for f in FAMILIES if extra.get("attention") != "local" or not TINY[f].get("sliding_window")]


@pytest.mark.parametrize("name,family", [(n, f) for n in sorted(EXTRA) for f in families_for(EXTRA[n][2])])
def test_layout_options_change_nothing(parity, name, family):
    d = parity[(name, family)]
    assert_logits_on_every_dp_rank(d)
    assert d["missing_grads"] == []
    assert not grad_mismatches(d["grads"], GRAD_RTOL), family


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_hf(parity, family, tp, pp):
    assert_logits_on_every_dp_rank(parity[(f"tp{tp}_pp{pp}", family)])


@pytest.mark.parametrize("tp,pp", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_gradients_match_hf_per_parameter(parity, family, tp, pp):
    assert parity[(f"tp{tp}_pp{pp}", family)]["missing_grads"] == []
    bad = grad_mismatches(parity[(f"tp{tp}_pp{pp}", family)]["grads"], GRAD_RTOL)
    assert not bad, bad

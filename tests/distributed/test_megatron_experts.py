"""``model.experts_implementation`` on the megatron path: the toolkit's grouped experts
(``toolkit/adapters/megatron/experts.py``, ``torch._grouped_mm``) against megatron-core's ``SequentialMLP``
through whole engines on 2 gloo ranks at EP=2 (dense parameters DP=2), fp32, load-balancing loss on,
for mixtral, qwen2_moe (shared expert) and qwen3_moe: losses, logits and every parameter's whole
gradient agree; a checkpoint the grouped engine saved after a step loads into the eager engine, whose
next step equals the grouped engine's. (TP=2 with sequence parallelism x EP=2 and PP=2 x EP=2 run the
grouped module against HF's own forward in tests/distributed/test_moe.py: ``auto`` picks it there.)"""
from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers.parity import batches, grad_gap, grad_mismatches, worst_ratio
from tests.helpers.ranks import run_ranks
from toolkit.config import validate
from toolkit.families.tiny import TINY_MOE, tiny_model
from toolkit.loss import IGNORE_INDEX

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

FAMILIES = sorted(TINY_MOE)
CHECKPOINT_FAMILY = "qwen2_moe"
LOSS_RTOL = 1e-6  # measured 0: on CPU each group's matmul is the per-expert one
GRAD_RTOL = 2e-6  # per parameter, relative to its own max |grad|; measured 0 for every parameter
LR = 1e-2


def _config(impl: str):
    return validate({"backend": "megatron", "megatron": {"ep": 2}, "model": {"experts_implementation": impl},
                     "train": {"global_batch_size": 4, "micro_batch_size": 1, "moe_aux_loss_coeff": 0.1}})


def _rank_job(rank, world, ckpt_root):
    from tests.helpers.ranks import release_megatron
    results = {}
    for family in FAMILIES:
        model = tiny_model(family)
        micro = batches(model.config.vocab_size, n_micro=4, mbs=1)
        tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
        for impl in ("eager", "grouped_mm"):
            results[(family, impl)] = _gradients(model, impl, micro, tokens)
            release_megatron()
        if family == CHECKPOINT_FAMILY:
            results["checkpoint"] = _across_implementations(model, micro, tokens, ckpt_root / family)
            release_megatron()
    return results


def _gradients(model, impl: str, micro, tokens) -> dict:
    from tests.helpers.ranks import megatron_engine
    from toolkit.adapters.megatron.experts import grouped_sequential_mlp_class
    engine = megatron_engine(_config(impl), model)
    grouped = sum(isinstance(m, grouped_sequential_mlp_class()) for c in engine.model for m in c.modules())
    mine = micro[engine.dp_rank::engine.dp_size]
    logits = engine.logits(mine)
    with _counted_dispatch() as sent:
        totals = engine.forward_backward(mine, tokens, complete_grads=True)
    torch.distributed.all_reduce(totals)
    return {"loss": totals[0].item() / tokens, "logits": logits, "grads": engine.hf_state(attr="main_grad"),
            "records": engine.setup_records, "grouped_modules": grouped, "dispatch": sent}


@contextlib.contextmanager
def _counted_dispatch():
    """megatron's sequence-parallel all-gathers and reduce-scatters (its ``allgather`` token dispatcher's
    collectives) counted: {kind: [count, bytes of the whole gathered / scattered tensor]}."""
    from megatron.core.tensor_parallel import mappings
    sent = {"all-gather": [0, 0], "reduce-scatter": [0, 0]}
    originals = mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func

    def counting(kind, fn, whole):
        def call(output, input_, group=None, **kw):
            sent[kind][0] += 1
            sent[kind][1] += (output if whole == "output" else input_).numel() * output.element_size()
            return fn(output, input_, group=group, **kw)
        return call
    mappings.dist_all_gather_func = counting("all-gather", originals[0], "output")
    mappings.dist_reduce_scatter_func = counting("reduce-scatter", originals[1], "input")
    try:
        yield sent
    finally:
        mappings.dist_all_gather_func, mappings.dist_reduce_scatter_func = originals


def _across_implementations(model, micro, tokens, path) -> dict:
    """Grouped: a step, save, another step. Eager: load that checkpoint, the same second step."""
    from tests.helpers.ranks import megatron_engine, release_megatron
    grouped = megatron_engine(_config("grouped_mm"), model)
    mine = micro[grouped.dp_rank::grouped.dp_size]
    grouped.train_step(mine, tokens, LR)
    grouped.save(path)
    saved = grouped.hf_state()
    second = grouped.train_step(mine, tokens, LR).loss
    release_megatron()
    eager = megatron_engine(_config("eager"), model)
    eager.load(path)
    loaded = eager.hf_state()
    return {"saved_equals_loaded": None if saved is None else all(torch.equal(saved[k], loaded[k]) for k in saved),
            "grouped_second": second, "eager_second": eager.train_step(mine, tokens, LR).loss}


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_experts")
    return run_ranks(_rank_job, 2, root, root, timeout=600)[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_experts_give_sequential_mlps_losses_logits_and_gradients(steps, family):
    eager, grouped = steps[(family, "eager")], steps[(family, "grouped_mm")]
    for impl, run in (("eager", eager), ("grouped_mm", grouped)):
        assert run["records"] == [{"event": "experts", "experts_implementation": impl, "requested": impl,
                                   "fallback_reason": None}]
    assert (eager["grouped_modules"], grouped["grouped_modules"]) == (0, 2)  # one per MoE layer
    assert grouped["loss"] == pytest.approx(eager["loss"], rel=LOSS_RTOL)
    assert max((a - b).abs().max().item() for a, b in zip(grouped["logits"], eager["logits"])) <= 1e-6
    assert sorted(grouped["grads"]) == sorted(eager["grads"])
    gaps = {n: grad_gap(grouped["grads"][n], g) for n, g in eager["grads"].items()}
    print(f"\n{family} megatron EP=2 grouped vs sequential: loss {grouped['loss']!r} vs {eager['loss']!r}; "
          f"worst gradient gap {worst_ratio(gaps)}")
    bad = grad_mismatches(gaps, GRAD_RTOL)
    assert not bad, bad


def test_a_grouped_checkpoint_loads_into_sequential_experts_and_continues(steps):
    d = steps["checkpoint"]
    assert d["saved_equals_loaded"] is True
    assert d["eager_second"] == pytest.approx(d["grouped_second"], rel=LOSS_RTOL)


def test_estimated_dispatcher_collectives_are_what_megatron_sends(steps):
    """``toolkit estimate``'s megatron EP rows (``estimate/steptime.py``'s ``_megatron_dispatcher``): the
    count and bytes of the allgather dispatcher's all-gathers and reduce-scatters over the tp x ep group
    in one step, against megatron's own calls (2 micro-batches of 16 tokens per rank, 2 MoE layers)."""
    from toolkit.estimate.steptime import Cluster, step_time
    from toolkit.families.tiny import tiny_config
    from toolkit.plan import build_plan
    cfg = _config("grouped_mm").model_copy(deep=True)
    cfg.data.seq_len = 16  # tests/helpers/parity.batches' rows
    for family in FAMILIES:
        plan = build_plan(cfg, [2], hf_config=tiny_config(family))
        step = step_time(plan.config, plan.model, plan.layout(2), Cluster(nodes=1, gpus_per_node=2))
        estimated = {kind: [sum(c.count for c in step.collectives if c.group == "ep" and c.kind == kind),
                            sum(c.count * c.nbytes for c in step.collectives if c.group == "ep" and c.kind == kind)]
                     for kind in ("all-gather", "reduce-scatter")}
        print(f"\n{family} megatron EP=2 dispatcher, estimated vs measured [count, bytes]: {estimated} "
              f"{steps[(family, 'grouped_mm')]['dispatch']}")
        assert steps[(family, "grouped_mm")]["dispatch"] == estimated

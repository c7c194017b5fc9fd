"""The estimate's mixture-of-experts rows (``toolkit/estimate/moe.py``) against figures computed by hand on
the tiny Mixtral (hidden 64, expert width 48, 4 experts top-2, 2 layers): ZeRO with expert parallelism
(the tokens' all-to-all, the experts' share of memory and ZeRO collectives), ZeRO-3 with the experts
gathered, and the side-by-side table ``toolkit estimate`` prints. The megatron EP rows are checked
against the collectives megatron itself sends: tests/distributed/test_megatron_experts.py."""
from __future__ import annotations

import pytest

from toolkit.config import ConfigError, load_config, validate
from toolkit.estimate.memory import memory
from toolkit.estimate.run import moe_comparison
from toolkit.estimate.steptime import Cluster, step_time
from toolkit.families.tiny import tiny_config
from toolkit.plan import build_plan

H, F, E, K, LAYERS = 64, 48, 4, 2, 2
EXPERT_PARAMS = 3 * F * H * E * LAYERS  # gate, up and down of every expert: 73,728
MB, SEQ, GBS, WORLD = 2, 32, 8, 4
TOKENS = MB * SEQ  # per rank and micro-batch
M = GBS // (MB * WORLD)  # micro-batches per rank: 1


def _plan(*sets: str, world: int = WORLD):
    cfg = load_config(None, [f"train.global_batch_size={GBS}", f"train.micro_batch_size={MB}", f"data.seq_len={SEQ}",
                             *sets])
    return build_plan(cfg, [world], hf_config=tiny_config("mixtral"))


def _collectives(plan, ep: int):
    step = step_time(plan.config, plan.model, plan.layout(WORLD), Cluster(nodes=1, gpus_per_node=WORLD), ep=ep)
    return {(c.kind, c.group): (c.ranks, c.nbytes, c.count) for c in step.collectives}


def test_the_spec_counts_the_experts_by_hand():
    assert sum(_plan().model.per_layer_experts) == EXPERT_PARAMS


@pytest.mark.parametrize("checkpointing,passes", [(False, 4), (True, 6)])
def test_zero_ep_all_to_all_and_expert_collectives(checkpointing, passes):
    plan = _plan("zero.stage=2", f"model.activation_checkpointing={str(checkpointing).lower()}")
    got = _collectives(plan, ep=2)
    # T x k token copies of h fp32 values per rank, dispatch + combine forward and backward (+ recompute)
    assert got[("all-to-all", "ep")] == (2, TOKENS * K * H * 4, passes * M * LAYERS)
    # each expert's ZeRO-2 reduce-scatter and all-gather over the 4 / 2 ranks holding it, of E / 2 experts
    assert got[("reduce-scatter", "expert-dp")] == got[("all-gather", "expert-dp")] == (2, EXPERT_PARAMS / 2 * 4, 1)
    dense = plan.model.total - EXPERT_PARAMS
    assert got[("reduce-scatter", "dp")] == (WORLD, dense * 4, 1)
    assert ("all-to-all", "ep") not in _collectives(plan, ep=1)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_zero_ep_memory_holds_a_share_of_the_experts(stage):
    plan = _plan(f"zero.stage={stage}")
    lay = plan.layout(WORLD)
    one, two = (memory(plan.config, plan.model, lay, ep=ep) for ep in (1, 2))
    held = EXPERT_PARAMS / 2 * 4  # fp32 bytes of the experts a rank no longer holds at ep = 2
    assert one.weights - two.weights == pytest.approx(held if stage < 3 else 0)
    assert one.gradients - two.gradients == pytest.approx(held if stage == 0 else 0)
    assert one.optimizer - two.optimizer == pytest.approx(8 * EXPERT_PARAMS / 2 if stage == 0 else 0)
    if stage == 3:  # the current and the prefetched layer gathered: half their experts
        assert one.buffers - two.buffers == pytest.approx(2 * EXPERT_PARAMS / LAYERS / 2 * 4)
    # the dispatched rows kept for the backward, per MoE layer
    assert two.activations - one.activations == pytest.approx(2 * TOKENS * K * H * 4 * LAYERS)


def test_the_comparison_puts_zero3_zero_ep_and_megatron_ep_side_by_side():
    plan = _plan("zero.stage=2")
    table = moe_comparison(plan.config, plan.model, Cluster(nodes=1, gpus_per_node=WORLD))
    assert table["ep"] == 4 and table["ep_source"].startswith("the largest dividing")
    names = [r["name"] for r in table["rows"]]
    assert names == ["ZeRO-3, experts gathered", "ZeRO-2 EP=4 (zero.ep)", "megatron EP=4 (allgather)"]
    zero3, zero_ep, mcore = table["rows"]
    assert mcore["layout"] == "tp=1 pp=1 dp=4 ep=4 recompute=none"
    # ZeRO-3 gathers every expert for every micro-batch forward and backward and reduce-scatters their
    # gradients: 3 x M collectives of the experts' fp32 bytes, each rank sending 3/4 of them
    assert zero3["expert_bytes"] == pytest.approx(3 * M * EXPERT_PARAMS * 4 * 3 / 4)
    # ZeRO EP=4: no expert-data-parallel replica; the all-to-all sends 3/4 of T x k x h x w, 4 x per layer
    assert zero_ep["expert_bytes"] == pytest.approx(4 * M * LAYERS * TOKENS * K * H * 4 * 3 / 4)
    assert zero_ep["expert_bytes"] < zero3["expert_bytes"]
    assert moe_comparison(plan.config, plan.model, Cluster(nodes=1, gpus_per_node=WORLD), ep=2)["ep_source"] == "--ep"


def test_a_bad_ep_names_the_valid_ones():
    plan = _plan()
    with pytest.raises(ConfigError, match=r"--ep=3: expert parallelism splits 4 experts over 4 ranks; choose ep in "
                                          r"\[1, 2, 4\]"):
        moe_comparison(plan.config, plan.model, Cluster(nodes=1, gpus_per_node=WORLD), ep=3)


def test_a_dense_model_has_no_moe_rows():
    from toolkit.estimate.run import estimate
    plan = build_plan(validate({}), [2])  # the demo's tiny Llama
    assert estimate(plan, Cluster(nodes=1, gpus_per_node=2), 80.0)["moe"] is None

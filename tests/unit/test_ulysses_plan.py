"""``zero.sp`` (DeepSpeed's Ulysses sequence parallelism) in the plan: the layout it makes (world = dp x
sp, the DeepSpeed JSON's batch arithmetic over dp, the record a checkpoint keeps), the refusals before
launch, each naming the valid choices, and what the estimate counts per rank."""
from __future__ import annotations

import pytest

from toolkit.config import ConfigError, validate
from toolkit.families.tiny import tiny_config
from toolkit.plan import build_plan


def plan(world: int = 4, family: str = "llama", sp: int = 2, hf: dict | None = None, **sections):
    raw = {"zero": {"sp": sp, **sections.pop("zero", {})}, "data": {"seq_len": 32, **sections.pop("data", {})},
           "train": {"global_batch_size": 8, "micro_batch_size": 2, **sections.pop("train", {})}, **sections}
    return build_plan(validate(raw), [world], hf_config=tiny_config(family, **(hf or {})))


def test_the_world_is_dp_by_sp_and_deepspeed_sees_dp_ranks_of_data():
    p = plan(world=4, sp=2)
    lay = p.layout(4)
    assert (lay.dp, lay.sp, lay.micro_batches) == (2, 2, 2)
    assert lay.record() == {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2, "sp": 2}
    assert "sp=2" in lay.describe()
    ds = p.ds_config(4)
    assert ds["sequence_parallel_size"] == 2
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 2
    one = plan(world=4, sp=1).layout(4)
    assert one.record() == {"dp": 4, "tp": 1, "pp": 1, "zero_stage": 2}  # sp=1 records what it always did
    assert "sequence_parallel_size" not in plan(world=4, sp=1).ds_config(4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(world=3, sp=2), r"world size 3 is not divisible by zero.sp=2 .* choose sp in \[1\] or nproc a multiple of 2"),
    (dict(world=4, sp=4, hf={"num_attention_heads": 6, "num_key_value_heads": 3, "hidden_size": 96}),
     r"num_attention_heads=6 and num_key_value_heads=3 do not split over zero.sp=4 .* choose sp in \[1, 3, 6\]"),
    (dict(world=4, sp=4, hf={"num_attention_heads": 4, "num_key_value_heads": 2}, data={"seq_len": 30}),
     r"data.seq_len=30 is not divisible by zero.sp=4.* a multiple of 4, or sp in \[1, 2\]"),
    (dict(world=2, sp=2, backend="megatron"), r"zero.sp=2 is DeepSpeed's .* backend=megatron; unset zero.sp"),
])
def test_refusals_name_the_valid_choices(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        plan(**kwargs)


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_mixture_of_experts_models_take_sp(family):
    """MoE is no longer refused: the load-balancing loss sums the routers' counts over the sequence
    group (``adapters/deepspeed/moe.py``; ``tests/distributed/test_ulysses.py`` checks it against HF)."""
    lay = plan(world=2, sp=2, family=family, zero={"stage": 3}).layout(2)
    assert (lay.dp, lay.sp, lay.zero_stage) == (1, 2, 3)


def test_more_ranks_than_kv_heads_replicate_them_as_deepspeed_does():
    """One KV head over sp=2: DeepSpeed's all-to-all gives each rank a copy (valid); sp must still
    divide the query heads."""
    assert plan(world=2, sp=2, hf={"num_key_value_heads": 1}).layout(2).sp == 2
    with pytest.raises(ConfigError, match=r"choose sp in \[1, 2, 4\]"):
        plan(world=8, sp=8, hf={"num_key_value_heads": 1})


def test_sp_must_be_positive():
    with pytest.raises(ConfigError, match="zero.sp"):
        validate({"zero": {"sp": 0}})


def test_the_estimate_counts_a_rank_s_tokens_and_zero_over_the_whole_world():
    """Activations and logits per rank fall as 1/sp; ZeRO-3 weights shard over dp x sp ranks."""
    from toolkit.estimate.memory import memory
    one, two = plan(world=2, sp=1, zero={"stage": 3}), plan(world=2, sp=2, zero={"stage": 3})
    m1 = memory(one.config, one.model, one.layout(2))
    m2 = memory(two.config, two.model, two.layout(2))
    assert m2.activations == pytest.approx(m1.activations / 2)
    assert m2.logits_loss == pytest.approx(m1.logits_loss / 2)
    assert (m2.weights, m2.optimizer) == (m1.weights, m1.optimizer)  # 2 partitions either way


def test_the_step_time_counts_ulysses_all_to_alls():
    from toolkit.estimate.steptime import Cluster, step_time
    p = plan(world=2, sp=2)
    kinds = {(c.kind, c.group) for c in step_time(p.config, p.model, p.layout(2), Cluster()).collectives}
    assert ("all-to-all", "sp") in kinds


def test_zero3_keeps_the_reduce_path_the_engine_corrects(tmp_path):
    """At ZeRO-3 DeepSpeed's reduce-scatter forgets sp (``ulysses.average_zero3_grads_over_dp``): the plan
    keeps ``reduce_scatter`` on, and a JSON turning it off is refused naming zero.sp."""
    import json
    assert plan(world=2, sp=2, zero={"stage": 3}).ds_config(2)["zero_optimization"]["reduce_scatter"] is True
    assert "reduce_scatter" not in plan(world=2, sp=1, zero={"stage": 3}).ds_config(2)["zero_optimization"]
    path = tmp_path / "z3.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3, "reduce_scatter": False}}))
    with pytest.raises(ConfigError, match="reduce_scatter=False contradicts zero.sp > 1 at ZeRO-3"):
        plan(world=2, sp=2, zero={"stage": 3, "ds_config": str(path)})


def test_checkpoints_of_as_many_zero_partitions_load_as_they_are():
    """ZeRO writes one partition per rank of dp x sp: sp=2 x dp=1 is sp=1 x dp=2 file for file; a
    different count or stage needs the converter (which is told dp x sp partitions)."""
    from toolkit.adapters.deepspeed.ulysses import same_zero_files
    from toolkit.layout import zero_partitions
    sp2 = {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 2, "sp": 2}
    assert same_zero_files(sp2, {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2})
    assert not same_zero_files(sp2, {"dp": 1, "tp": 1, "pp": 1, "zero_stage": 2})
    assert not same_zero_files(sp2, {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 3})
    assert (zero_partitions(sp2), zero_partitions({"dp": 3})) == (2, 3)

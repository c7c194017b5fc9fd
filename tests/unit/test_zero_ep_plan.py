"""``zero.ep`` (expert parallelism through DeepSpeed's AutoEP) before launch: the layout and its checkpoint
record, the DeepSpeed JSON's ``expert_parallel`` block, every refusal with its fix, the transformers 5.24
compat patch and the AutoEP -> transformers name table. What runs is in ``tests/e2e/test_zero_ep.py``."""
from __future__ import annotations

import re

import pytest

from toolkit.config import ConfigError, validate
from toolkit.families.tiny import tiny_config
from toolkit.plan import build_plan


def plan(world: int = 2, family: str = "mixtral", ep: int = 2, hf: dict | None = None, config=None, **sections):
    raw = {"zero": {"ep": ep, **sections.pop("zero", {})}, "data": {"seq_len": 32, **sections.pop("data", {})},
           "train": {"global_batch_size": 8, "micro_batch_size": 2, **sections.pop("train", {})}, **sections}
    return build_plan(validate(raw), [world], hf_config=config or tiny_config(family, **(hf or {})))


@pytest.mark.parametrize("family, preset", [("mixtral", "mixtral"), ("qwen2_moe", "qwen3_moe"),
                                            ("qwen3_moe", "qwen3_moe")])
def test_layout_record_and_deepspeed_block(family, preset):
    p = plan(family=family)
    lay = p.layout(2)
    assert (lay.dp, lay.ep) == (2, 2) and "ep=2" in lay.describe()
    assert lay.record() == {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2, "ep": 2}
    block = p.ds_config(2)["expert_parallel"]
    assert block["enabled"] and block["autoep_size"] == 2 and block["preset_model"] == preset
    assert block["disable_triton_grouped_mm"] is True and block["use_grouped_mm"] is True  # auto: torch's grouped mm
    assert plan(family=family, model={"experts_implementation": "eager"}).ds_config(2)["expert_parallel"][
        "use_grouped_mm"] is False  # model.experts_implementation=eager: AutoEP's loop over its local experts
    pattern = re.compile(block["moe_layer_pattern"])  # AutoEP fullmatches module names, also under peft
    assert pattern.fullmatch("model.layers.11.mlp") and pattern.fullmatch("base_model.model.model.layers.0.mlp")
    assert not pattern.fullmatch("model.layers.0.mlp.experts") and not pattern.fullmatch("model.layers.0.self_attn")
    one = plan(family=family, ep=1)
    assert one.layout(2).record() == {"dp": 2, "tp": 1, "pp": 1, "zero_stage": 2}  # ep=1 records what it did
    assert "expert_parallel" not in one.ds_config(2)


def test_ep_changes_the_zero_files():
    from toolkit.adapters.deepspeed.ulysses import same_zero_files
    ep2, ep1 = plan().layout(2).record(), plan(ep=1).layout(2).record()
    assert same_zero_files(ep2, ep2) and not same_zero_files(ep2, ep1) and not same_zero_files(ep1, ep2)


def _olmoe():
    from transformers import AutoConfig
    return AutoConfig.for_model("olmoe", hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=250, num_experts=4,
                                num_experts_per_tok=2)


@pytest.mark.parametrize("kwargs, message", [
    (dict(family="llama"), r"zero.ep=2 is expert parallelism and needs a mixture-of-experts model; llama has no "
                           r"experts: unset zero.ep"),
    (dict(config="olmoe"), r"no preset for olmoe .* set zero.ep=1 .* or backend=megatron"),
    (dict(world=3, ep=3), r"4 experts do not divide over zero.ep=3; choose zero.ep in \[1\]"),
    (dict(world=2, ep=4), r"world size 2 is not divisible by zero.ep=4 .* choose zero.ep in \[1, 2\] or nproc a "
                          r"multiple of 4"),
    (dict(world=4, zero={"sp": 2}), r"does not run with zero.sp=2 .* set zero.sp=1 or zero.ep=1"),
    (dict(zero={"tiled_mlp": True}), r"zero.tiled_mlp would tile; set zero.tiled_mlp=false"),
    (dict(hf={"router_jitter_noise": 0.1}), r"router_jitter_noise=0.1 would be ignored; set router_jitter_noise=0"),
    (dict(lora={"rank": 8, "target_modules": ["q_proj"], "modules_to_save": ["gate"]},
          model={"init": "pretrained"}),
     r"does not train lora.modules_to_save=\['gate'\]: AutoEP replaces the MoE blocks' routers and experts .* "
     r"leave them out .* or zero.ep=1"),
    (dict(lora={"rank": 8, "target_modules": ["q_proj"]}), r"with LoRA needs model.init=pretrained: hf_final/ merges"),
    (dict(train={"objective": "orpo"}, data={"template": "preference", "packing": "documents"}),
     r"tested with train.objective=sft only, not orpo; set zero.ep=1 for orpo"),
    (dict(zero={"offload_optimizer": True}), r"not tested with offloading .* unset them, or set zero.ep=1"),
    (dict(backend="megatron"), r"zero.ep=2 is DeepSpeed.s .*ignored by backend=megatron; unset zero.ep \(or set backend"),
])
def test_refusals_name_the_fix(kwargs, message):
    if kwargs.get("config") == "olmoe":
        kwargs["config"] = _olmoe()
    with pytest.raises(ConfigError, match=message):
        plan(**kwargs)


def test_lora_on_attention_is_planned():
    """Adapters on attention, experts and routers frozen: DeepSpeed runs it as a dense model
    (``compat/deepspeed_frozen_experts.py``; trained in tests/e2e/test_zero_ep.py)."""
    p = plan(family="qwen2_moe", lora={"rank": 8, "target_modules": ["q_proj", "o_proj"]},
             model={"init": "pretrained"})
    assert p.layout(2).ep == 2 and p.lora.targets == ["q_proj", "o_proj"]
    with pytest.raises(ConfigError, match=r"does not put LoRA on the shared expert .* AutoEP moves it .*"
                                          r"lora.target_modules=\[q_proj,k_proj,v_proj,o_proj\]"):
        plan(family="qwen2_moe", lora={"rank": 8}, model={"init": "pretrained"})  # all-linear


def test_compat_patch_takes_autoeps_string_keys_and_keeps_models():
    from transformers.utils import output_capturing as oc

    from toolkit.compat import transformers_autoep
    from toolkit.families.tiny import tiny_model
    transformers_autoep.install()
    assert not transformers_autoep.needs_patch()  # the registry now takes a default
    registry, missing = oc._CanRecordRegistry(), object()
    assert registry.get("<class 'X'>", missing) is missing  # DeepSpeed 0.19.8's call
    registry["<class 'X'>"] = {"router_logits": 1}  # its restore writes the key it read, not "<class 'str'>"
    assert dict(registry) == {"<class 'X'>": {"router_logits": 1}}
    model = tiny_model("mixtral")
    registry[model] = {"router_logits": 2}  # transformers' own use: keyed by the model's class
    assert registry.get(model) == {"router_logits": 2} and str(model.__class__) in registry


def test_autoep_names_map_to_transformers():
    from toolkit.formats.zero_autoep import AUTOEP_EXPERTS, hf_name
    blocks = {"model.layers.0.mlp", "model.layers.1.mlp"}
    assert hf_name("model.layers.1.mlp.router.gate.weight", blocks) == "model.layers.1.mlp.gate.weight"
    assert hf_name("model.layers.1.mlp.gate.gate.weight", blocks) == "model.layers.1.mlp.gate.weight"
    assert hf_name("model.layers.0.mlp.shared_experts.up_proj.weight", blocks) == \
        "model.layers.0.mlp.shared_expert.up_proj.weight"
    assert hf_name("model.layers.0.mlp.shared_experts_gate.weight", blocks) == \
        "model.layers.0.mlp.shared_expert_gate.weight"
    assert hf_name("model.layers.0.self_attn.q_proj.weight", blocks) == "model.layers.0.self_attn.q_proj.weight"
    assert hf_name("model.layers.2.mlp.gate.weight", blocks) == "model.layers.2.mlp.gate.weight"  # not AutoEP's
    assert AUTOEP_EXPERTS == {"gate_up_proj": ("w1", "w3"), "down_proj": ("w2",)}

"""LoRA on the megatron path (``toolkit/adapters/megatron/lora.py``) against references we did not
write: HF + ``peft`` on the same weights and adapters.

- parity: at TP=2, PP=2 and TP=2 with sequence parallelism (2 gloo ranks, one launch per layout,
  every family in turn), for llama, qwen2 (tied, q/k/v biases), qwen2_moe (adapters on attention
  and the shared expert; routed experts are refused in the plan) and gpt2 (packed ``c_attn``), the
  engine's logits and every adapter's gradient equal a single-process HF + peft model's (fp32);
- the adapters a megatron run starts from are peft's own init, drawn as the DeepSpeed path draws
  them.
"""
from __future__ import annotations

import pytest
import torch

from tests.test_families import tiny_config, tiny_model
from tests.test_lora import ALPHA, RANK, reference, seeded_adapter
from tests.test_megatron_compat import run_ranks
from tests.test_megatron_parity import batches
from toolkit.config import ConfigError, validate

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")

FAMILIES = ("llama", "qwen2", "qwen2_moe", "gpt2")
LAYOUTS = {"tp2": (2, 1, {}), "pp2": (1, 2, {}), "tp2_sp": (2, 1, {"sequence_parallel": True})}
MOE = ("qwen2_moe",)
CASES = [(f, lay) for lay in LAYOUTS for f in FAMILIES if not (f in MOE and lay == "tp2")]
"""(family, layout): megatron's MoE layer needs sequence parallelism under TP, so qwen2_moe's TP=2 is tp2_sp."""
LOGIT_TOL = 2e-6  # as the full-model megatron parity (other matmul shapes, reduction orders)
GRAD_RTOL = 2e-5  # per adapter matrix: max |megatron - peft| <= GRAD_RTOL x max |peft|


def lora_config(tp: int, pp: int, **megatron):
    return validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp, **megatron},
                     "lora": {"rank": RANK, "alpha": ALPHA},
                     # the reference's objective is the token loss alone: no MoE load-balancing term
                     "train": {"global_batch_size": 4, "micro_batch_size": 1, "moe_aux_loss_coeff": 0.0}})


def test_plan_refuses_what_megatron_lora_cannot_do():
    from toolkit.plan import build_plan
    with pytest.raises(ConfigError, match="modules_to_save=\\['lm_head'\\]: modules trained in full"):
        build_plan(validate({"backend": "megatron", "lora": {"rank": 4, "modules_to_save": ["lm_head"]}}), [1],
                   hf_config=tiny_config("llama"))
    with pytest.raises(ConfigError, match="routed experts that transformers packs as 3-D parameters"):
        build_plan(validate({"backend": "megatron", "lora": {"rank": 4, "target_modules": ["down_proj"]}}), [1],
                   hf_config=tiny_config("qwen2_moe"))


def test_adapters_are_drawn_as_the_deepspeed_path_draws_them():
    """peft's init from (seed, "lora") on a skeleton equals ``apply_lora`` on the real model."""
    from toolkit.adapters.lora import apply_lora
    from toolkit.adapters.megatron.lora import draw_adapters
    from toolkit.plan import build_plan
    for family in ("llama", "gpt2"):
        plan = build_plan(lora_config(1, 1), [1], hf_config=tiny_config(family))
        want = {n: p for n, p in apply_lora(tiny_model(family), plan.lora, seed=7).named_parameters() if p.requires_grad}
        got = draw_adapters(tiny_config(family), plan.lora, seed=7)
        assert sorted(got) == sorted(want)
        assert all(torch.equal(got[n], want[n]) for n in want), family


def _rank_parity(rank, world, layouts, base_dirs):
    from megatron.core import parallel_state
    from transformers import AutoModelForCausalLM

    from toolkit.adapters.megatron import MegatronEngine
    from toolkit.adapters.megatron.lora import draw_adapters
    from toolkit.plan import build_plan
    results = {}
    for name, (tp, pp, extra) in layouts.items():
        for family, base_dir in base_dirs.items():
            if (family, name) not in CASES:
                continue
            model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            plan = build_plan(lora_config(tp, pp, **extra), [world], hf_config=model.config)
            values = {n: seeded_adapter(n, tuple(t.shape))
                      for n, t in draw_adapters(model.config, plan.lora, 0).items()}
            engine = MegatronEngine(plan, model.state_dict(), adapters=values)
            micro = batches(model.config.vocab_size)
            tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro)
            logits = engine.logits(micro)
            engine.forward_backward(micro, tokens, complete_grads=True)
            results[(name, family)] = {"logits": logits, "targets": plan.lora.targets, "grads": engine.adapter_state("main_grad"),
                                       "trainable": sum(p.numel() for p in engine.parameters() if p.requires_grad),
                                       "optimized": sum(p.numel() for g in engine.optimizer.param_groups
                                                        for p in g["params"])}
            parallel_state.destroy_model_parallel()
    return results


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lora_bases")
    for family in FAMILIES:
        tiny_model(family).save_pretrained(root / family)
    return {f: str(root / f) for f in FAMILIES}


@pytest.fixture(scope="module")
def parity(base_dirs, tmp_path_factory):
    out = {}
    for name, layout in LAYOUTS.items():
        ranks = run_ranks(_rank_parity, 2, tmp_path_factory.mktemp(f"lora_{name}"), {name: layout}, base_dirs,
                          timeout=900)
        for key, d in ranks[0].items():  # rank 0 has the grads; the last stage's TP rank 0 the logits
            d["logits"] = next(r[key]["logits"] for r in ranks if r[key]["logits"] is not None)
            d["trainable_per_rank"] = [r[key]["trainable"] for r in ranks]
            out[key] = d
    return out


@pytest.mark.parametrize("family,layout", CASES)
def test_logits_and_adapter_grads_equal_hf_peft(family, layout, parity, base_dirs):
    d = parity[(layout, family)]
    micro = batches(tiny_config(family).vocab_size)
    # peft's own all-linear adapts qwen2_moe's shared_expert_gate too; the toolkit's never adapts gates
    ref_logits, ref_grads = reference(base_dirs[family], micro, targets=d["targets"])
    logit_gap = max((a - b).abs().max().item() for a, b in zip(d["logits"], ref_logits))
    grads = d["grads"]
    assert sorted(grads) == sorted(ref_grads)  # one adapter per HF projection, peft's names
    ratios = {n: (grads[n] - g).abs().max().item() / g.abs().max().item() for n, g in ref_grads.items()}
    worst = max(ratios, key=ratios.get)
    print(f"\n{family} {layout}: max logit gap {logit_gap:.2e}; worst adapter grad gap {ratios[worst]:.2e} "
          f"of its max ({worst})")
    assert logit_gap <= LOGIT_TOL
    assert ratios[worst] <= GRAD_RTOL, worst
    assert all(g.abs().max() > 0 for g in ref_grads.values())
    # the base is frozen: only adapters train, and the optimizer holds nothing else
    assert d["optimized"] == d["trainable"] > 0

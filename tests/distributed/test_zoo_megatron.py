"""The config zoo (``tests/helpers/zoo.py``) on the megatron LoRA path, one 2-rank gloo job for every
variant at the matrix's layout (TP 2, PP 2, or TP 2 with sequence parallelism), judged by HF +
``peft`` on the same base and adapters: logits and every adapter's gradient; where the matrix says
so, the engine's ``hf_final/`` is peft's merge of the ``adapter/`` it writes beside it, which holds
the adapters the engine was given. Cells the toolkit refuses are refused in the plan, by name."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.lora import (
    ALPHA,
    EXPORT_LOGIT_TOL,
    MEGATRON_GRAD_RTOL,
    MEGATRON_LOGIT_TOL,
    RANK,
    assert_adapters_match_peft,
    reference,
    seeded_adapter,
)
from tests.helpers.zoo import REFUSALS, VARIANTS, batches, cells, run_zoo_ranks, runs, save_base
from toolkit.config import validate

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")

LORA = runs("lora_megatron")
EXPORT = cells("export")
LAYOUTS = {"tp2": (2, 1, {}), "pp2": (1, 2, {}), "tp2_sp": (2, 1, {"sequence_parallel": True})}
MERGED_RTOL = 1e-6
"""hf_final vs peft's merge_and_unload of the exported adapter, per tensor relative to its largest
entry (the same fp32 product B @ A); measured 0.0 (bit-identical) for every variant."""


def lora_config(base: str, layout: str):
    tp, pp, extra = LAYOUTS[layout]
    return validate({"backend": "megatron", "megatron": {"tp": tp, "pp": pp, **extra},
                     "model": {"name_or_path": base, "init": "pretrained"},
                     "lora": {"rank": RANK, "alpha": ALPHA},
                     # the reference's objective is the token loss alone: no MoE load-balancing term
                     "train": {"global_batch_size": 4, "micro_batch_size": 1, "moe_aux_loss_coeff": 0.0}})


def _zoo_rank(rank, world, bases, root):
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from tests.helpers.ranks import release_megatron
    from toolkit.adapters.megatron import MegatronEngine
    from toolkit.lora.peft import draw_adapters
    from toolkit.plan import build_plan
    results = {}
    for variant, layout in LORA.items():
        if variant not in bases:  # not selected
            continue
        model = AutoModelForCausalLM.from_pretrained(bases[variant], dtype=torch.float32)
        plan = build_plan(lora_config(bases[variant], layout), [world], hf_config=model.config)
        values = {n: seeded_adapter(n, tuple(t.shape)) for n, t in draw_adapters(model.config, plan.lora, 0).items()}
        engine = MegatronEngine(plan, model.state_dict(), adapters=values)
        micro = batches(model.config.vocab_size)
        tokens = sum(int((mb["labels"] != -100).sum()) for mb in micro)
        logits = engine.logits(micro)
        engine.forward_backward(micro, tokens, complete_grads=True)
        results[variant] = {"logits": logits, "targets": plan.lora.targets, "grads": engine.adapter_state("main_grad")}
        if EXPORT[variant] == "lora-megatron":
            engine.export_hf(Path(root) / variant / "hf_final", None)
        release_megatron()
    return results


@pytest.fixture(scope="module")
def zoo(request, tmp_path_factory):
    ranks, bases, root = run_zoo_ranks(request, tmp_path_factory, "zoo_megatron", LORA, _zoo_rank)
    out = {}
    for variant, d in ranks[0].items():  # rank 0 has the grads; the last stage's TP rank 0 the logits
        d["logits"] = next(r[variant]["logits"] for r in ranks if r[variant]["logits"] is not None)
        out[variant] = d
    return {"results": out, "bases": bases, "root": root}


@pytest.mark.parametrize("variant", LORA)
def test_lora_logits_and_adapter_grads_equal_hf_peft(zoo, variant):
    d = zoo["results"][variant]
    ref_logits, ref_grads = reference(zoo["bases"][variant], batches(VARIANTS[variant].config().vocab_size),
                                      targets=d["targets"])
    logit_gap = max((a - b).abs().max().item() for a, b in zip(d["logits"], ref_logits))
    assert_adapters_match_peft(f"{variant} {LORA[variant]}", logit_gap, d["grads"], ref_grads, MEGATRON_LOGIT_TOL,
                               MEGATRON_GRAD_RTOL)


@pytest.mark.parametrize("variant", [v for v, how in EXPORT.items() if how == "lora-megatron"])
def test_lora_export_is_peft_s_merge_of_the_adapters_given(zoo, variant):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(zoo["bases"][variant], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, zoo["root"] / variant / "adapter").eval()
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert loaded and all(torch.equal(p, seeded_adapter(n, tuple(p.shape))) for n, p in loaded.items())
    hf_final = AutoModelForCausalLM.from_pretrained(zoo["root"] / variant / "hf_final", dtype=torch.float32).eval()
    ids = torch.randint(1, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        gap = (peft_model(input_ids=ids).logits - hf_final(input_ids=ids).logits).abs().max().item()
        merged = peft_model.merge_and_unload().state_dict()
    exported = hf_final.state_dict()
    assert sorted(exported) == sorted(merged)
    ratios = {n: ((t - merged[n]).abs().max() / merged[n].abs().max()).item() for n, t in exported.items()}
    worst = max(ratios, key=ratios.get)
    print(f"\n{variant}: adapter (peft) vs hf_final logits: max gap {gap:.2e}; worst merged tensor {ratios[worst]:.2e}")
    assert gap <= EXPORT_LOGIT_TOL
    assert ratios[worst] <= MERGED_RTOL, worst


@pytest.mark.parametrize("variant", [v for (v, f) in REFUSALS if f == "lora_megatron"])
def test_refused_cells_are_refused_in_the_plan_by_name(variant, tmp_path):
    from toolkit.config import ConfigError
    from toolkit.families import FamilyError
    from toolkit.plan import build_plan
    with pytest.raises((ConfigError, FamilyError), match=REFUSALS[(variant, "lora_megatron")]):
        build_plan(lora_config(save_base(variant, tmp_path), "tp2"), [2], hf_config=VARIANTS[variant].config())

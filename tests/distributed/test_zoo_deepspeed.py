"""The config zoo (``tests/helpers/zoo.py``) on the DeepSpeed path, one 2-rank gloo job for every variant,
judged by references we did not write:

- LoRA (the matrix's ZeRO stage): the engine's logits and adapter gradients equal a single-process
  HF + ``peft`` model's on the same base and adapters (``tests/helpers/lora.py``'s reference);
- resume at another layout: full fine-tuning saved by DeepSpeed at one ZeRO stage, converted to a
  universal checkpoint, loaded by DeepSpeed's own ``load_checkpoint`` at another stage, takes the
  same next step as the run that went on (loss and every fp32 weight);
- export: ``hf_final/`` of a full fine-tuning run holds what DeepSpeed's ``zero_to_fp32`` reads from
  the checkpoint saved at that step; of a LoRA run, it is peft's merge of the ``adapter/`` beside it,
  whose values are the engine's fp32 adapters;
- LoRA checkpoint conversion: the LoRA run's ZeRO checkpoint along the matrix's path (megatron,
  ZeRO, HF-PEFT), ``toolkit convert --verify`` at each hop, ends as peft loads the engine's adapters.
"""
from __future__ import annotations

import pytest
import torch

from tests.helpers.lora import (
    EXPORT_LOGIT_TOL,
    assert_adapters_match_peft,
    reference,
    seeded_lora_engine,
    step_global_batch,
)
from tests.helpers.zoo import VARIANTS, batches, cells, lora_convert_path, run_zoo_ranks, runs
from toolkit.config import validate
from toolkit.loss import IGNORE_INDEX

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

LORA = runs("lora_deepspeed")
RESUME = runs("resume")
EXPORT = cells("export")
LORA_CONVERT = runs("lora_convert")
RESUME_LOSS_RTOL = 1e-6  # the resumed step's loss vs the uninterrupted run's
RESUME_STEP_RTOL = 5e-3
"""Per parameter: max |resumed - uninterrupted| after the next step, relative to that step's largest
update (the weights it starts from are equal bit for bit; the stages reduce gradients in another
order, which Adam's normalized update carries into small-gradient entries); measured worst 6.3e-4
(llama-bias-yarn's k_proj.bias), <= 1.6e-4 for every other variant."""


def _stage(setting: str) -> int:
    return int(setting.removeprefix("zero").removeprefix("z"))


def _lora_case(rank, world, variant, base, root):
    """Logits and whole adapter gradients of the global batch at the matrix's stage, then one step
    and, where the matrix says so, the export (hf_final/ merged, adapter/ beside it)."""
    from deepspeed.utils import safe_get_full_fp32_param

    plan, engine = seeded_lora_engine(world, base, _stage(LORA[variant]))
    logits, grads = step_global_batch(engine, rank, world)
    result = {"logits": logits, "grads": grads, "targets": plan.lora.targets,
              "trained": {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()
                          if p.requires_grad}}
    if EXPORT[variant] == "lora-zero":
        engine.export_hf(root / variant / "lora" / "hf_final", None)
    _save_lora_checkpoint(rank, plan, engine, root / variant / "lora" / "ckpt")
    engine.engine.destroy()
    return result


def _save_lora_checkpoint(rank, plan, engine, ckpt):
    """The checkpoint a LoRA run writes at step 1 (``toolkit/checkpoint/checkpointer.py``): the
    engine's adapters and their Adam state, and meta.json naming the base."""
    import torch.distributed as dist

    from toolkit.checkpoint.lineage import lora_record
    from toolkit.storage import meta
    engine.save(ckpt / "engine", 1)
    if rank == 0:
        meta.write_descriptions(ckpt, "deepspeed", plan.model.model_type, plan.model.hf, engine.layout_record(),
                                "fp32", {"step": 1}, **lora_record(plan))
    dist.barrier()


def _full_engine(base, stage, world):
    from toolkit.adapters.deepspeed import DeepSpeedEngine, build_model
    from toolkit.plan import build_plan
    cfg = validate({"model": {"name_or_path": base, "init": "pretrained"}, "zero": {"stage": stage},
                    "train": {"global_batch_size": 4, "micro_batch_size": 1, "lr": 1e-3, "moe_aux_loss_coeff": 0.0}})
    plan = build_plan(cfg, [world])
    return DeepSpeedEngine(plan, build_model(plan, plan.ds_config(world)))


def _step(engine, rank, step):
    micro = batches(engine.module.config.vocab_size, seed=step)
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
    return engine.train_step(micro[rank * 2:(rank + 1) * 2], tokens, 1e-3).loss


def _fp32_weights(engine) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param
    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _resume_case(rank, world, variant, base, root):
    """Two steps at the first stage, saved (and exported where the matrix says so); the run goes on
    one step; DeepSpeed at the second stage loads the universal conversion and takes that step."""
    import torch.distributed as dist

    from toolkit.convert import convert
    saved, resumed = (int(s[1]) for s in RESUME[variant].split(">"))
    out = root / variant / "resume"
    engine = _full_engine(base, saved, world)
    for step in (1, 2):
        _step(engine, rank, step)
    engine.save(out / "ckpt", 2)
    if EXPORT[variant] == "zero":
        engine.export_hf(out / "hf_final", None)
    if rank == 0:
        engine.module.config.to_json_file(str(out / "ckpt" / "config.json"))
        convert(out / "ckpt", out / "universal", to="zero", dp=world, zero_stage=resumed)
    dist.barrier()
    at_save = _fp32_weights(engine)
    want_loss, want = _step(engine, rank, 3), _fp32_weights(engine)
    engine.engine.destroy()
    engine = _full_engine(base, resumed, world)
    engine.load(out / "universal" / "engine")
    loaded = _fp32_weights(engine)
    got_loss, got = _step(engine, rank, 3), _fp32_weights(engine)
    engine.engine.destroy()
    step_gaps = {n: ((got[n] - w).abs().max() / (w - at_save[n]).abs().max()).item() for n, w in want.items()}
    return {"loss": (got_loss, want_loss), "step_gaps": step_gaps, "names": sorted(got) == sorted(want),
            "loaded_exactly": sorted(n for n in at_save if n not in loaded or not torch.equal(loaded[n], at_save[n]))}


def _zoo_rank(rank, world, bases, root):
    from pathlib import Path
    root, out = Path(root), {}
    for variant, base in bases.items():
        if variant in LORA:
            out[(variant, "lora")] = _lora_case(rank, world, variant, base, root)
        if variant in RESUME:
            out[(variant, "resume")] = _resume_case(rank, world, variant, base, root)
    return out


@pytest.fixture(scope="module")
def zoo(request, tmp_path_factory):
    ranks, bases, root = run_zoo_ranks(request, tmp_path_factory, "zoo_deepspeed", VARIANTS, _zoo_rank)
    return {"ranks": ranks, "bases": bases, "root": root}


@pytest.mark.parametrize("variant", LORA)
def test_lora_logits_and_adapter_grads_equal_hf_peft(zoo, variant):
    res = [r[(variant, "lora")] for r in zoo["ranks"]]
    # the plan's targets: peft's own all-linear adapts packed experts and qwen2_moe's shared_expert_gate,
    # which the toolkit refuses / never adapts (tests/e2e/test_lora.py)
    ref_logits, ref_grads = reference(zoo["bases"][variant], batches(VARIANTS[variant].config().vocab_size),
                                      targets=res[0]["targets"])
    logit_gap = max((a - b).abs().max().item() for r, d in enumerate(res)
                    for a, b in zip(d["logits"], ref_logits[r * 2:(r + 1) * 2]))
    assert_adapters_match_peft(f"{variant} {LORA[variant]}", logit_gap, res[0]["grads"], ref_grads)


@pytest.mark.parametrize("variant", RESUME)
def test_resume_at_another_zero_stage_takes_the_uninterrupted_step(zoo, variant):
    for r, d in enumerate(r[(variant, "resume")] for r in zoo["ranks"]):  # each rank's own parameters' view
        got, want = d["loss"]
        worst = max(d["step_gaps"], key=d["step_gaps"].get)
        print(f"\n{variant} {RESUME[variant]} rank {r}: loss {got:.6f} vs {want:.6f}; worst gap after the step "
              f"{d['step_gaps'][worst]:.2e} of its update ({worst})")
        assert d["names"] and d["loaded_exactly"] == []  # DeepSpeed loaded the saved fp32 weights bit for bit
        assert got == pytest.approx(want, rel=RESUME_LOSS_RTOL)
        assert d["step_gaps"][worst] <= RESUME_STEP_RTOL, worst


@pytest.mark.parametrize("variant", [v for v, how in EXPORT.items() if how == "zero"])
def test_full_export_holds_what_zero_to_fp32_reads_from_the_checkpoint(zoo, variant):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoModelForCausalLM
    out = zoo["root"] / variant / "resume"
    ref = VARIANTS[variant].model(seed=5)
    ref.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(str(out / "ckpt")), strict=True)
    exported = AutoModelForCausalLM.from_pretrained(out / "hf_final", dtype=torch.float32).eval()
    want, got = ref.state_dict(), exported.state_dict()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    assert not torch.equal(want["lm_head.weight"], VARIANTS[variant].model().state_dict()["lm_head.weight"])  # trained
    ids = torch.randint(0, ref.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(exported(input_ids=ids).logits, ref.eval()(input_ids=ids).logits)


@pytest.mark.parametrize("variant", [v for v, how in EXPORT.items() if how == "lora-zero"])
def test_lora_export_is_peft_s_merge_of_the_engine_s_adapters(zoo, variant):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    out = zoo["root"] / variant / "lora"
    base = AutoModelForCausalLM.from_pretrained(zoo["bases"][variant], dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, out / "adapter").eval()
    trained = zoo["ranks"][0][(variant, "lora")]["trained"]
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    assert sorted(loaded) == sorted(trained)
    assert all(torch.equal(loaded[n], trained[n]) for n in trained)  # the engine's fp32 adapters, after a step
    hf_final = AutoModelForCausalLM.from_pretrained(out / "hf_final", dtype=torch.float32).eval()
    ids = torch.randint(1, base.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        gap = (peft_model(input_ids=ids).logits - hf_final(input_ids=ids).logits).abs().max().item()
        merged = peft_model.merge_and_unload().state_dict()
    exported = hf_final.state_dict()
    print(f"\n{variant}: adapter (peft) vs hf_final logits: max gap {gap:.2e}")
    assert gap <= EXPORT_LOGIT_TOL
    assert sorted(exported) == sorted(merged)
    differs = [n for n, t in exported.items() if not torch.equal(t, merged[n])]
    assert not differs, differs[:5]


@pytest.mark.parametrize("variant", list(LORA_CONVERT))
def test_lora_checkpoint_converts_along_its_path_verified_to_the_engine_s_adapters(zoo, variant):
    """`toolkit convert --verify` at every hop (tensors and Adam moments between checkpoints; peft's
    forward for a PEFT directory); the PEFT directory at the end, loaded by peft on the base, holds
    the adapters DeepSpeed's engine held when it saved."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.helpers.runs import run_in_process
    base = zoo["bases"][variant]
    prev = zoo["root"] / variant / "lora" / "ckpt"
    for i, (fmt, args) in enumerate(lora_convert_path(LORA_CONVERT[variant])[1:], 1):
        dst = zoo["root"] / variant / "lora" / f"{i}-{fmt}"
        out = run_in_process(["convert", str(prev), str(dst), "--to", fmt, *args, "--verify", "--base", base]).stdout
        assert "verify: OK" in out, out
        prev = dst
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), prev)
    loaded = {n: p for n, p in peft_model.named_parameters() if "lora_" in n}
    trained = zoo["ranks"][0][(variant, "lora")]["trained"]
    assert sorted(loaded) == sorted(trained)
    assert all(torch.equal(loaded[n], trained[n]) for n in trained)

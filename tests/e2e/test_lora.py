"""LoRA on the DeepSpeed path (``lora.*``, ``toolkit/lora/spec.py``, ``toolkit/lora/peft.py``)
against references we did not write: HF + ``peft`` on the same weights and adapters.

- names: bad targets, the MoE router and packed experts are refused before anything starts (megatron
  LoRA: tests/e2e/test_megatron_lora.py);
  the plan's trainable count is peft's;
- parity: at ZeRO-2 and ZeRO-3 (2 gloo ranks), for llama, qwen2 and gpt2, the engine's logits and
  adapter gradients equal a single-process HF + peft model's (fp32);
- training: ``toolkit train`` losses equal a single-process HF + peft + torch AdamW loop written
  here; kill -9 and ``--resume auto`` is bit-exact (the adapter Adam state is in the checkpoint);
  a resume on another base is refused naming both;
- exports: ``adapter/`` loads with ``PeftModel.from_pretrained`` and gives ``hf_final/``'s logits;
  ``hf_final/`` is peft's ``merge_and_unload()`` (on a pretrained base, bf16 runs included, and on
  a random-init base rebuilt from the seed);
- weight decay 1.0 and an engaged clip (0.05) against the peft loop: losses, grad norms, adapters;
  activation checkpointing counted as applied;
- refusals: resume with other lora.* settings, full <-> LoRA, a changed base, a ZeRO-0 converter
  source, ``--verify`` against damaged destinations.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.helpers.lora import (
    ALPHA,
    DECAY_CLIP,
    EXPORT_LOGIT_TOL,
    LORA_RUN,
    LOSS_RTOL,
    RANK,
    assert_adapters_match_peft,
    check_decay_and_clip_against_peft,
    check_random_init_export,
    peft_merge_gaps,
    reference,
    reference_losses,
    seeded_lora_engine,
    step_global_batch,
    tiny_bases,
    trained_once,
)
from tests.helpers.parity import batches
from tests.helpers.ranks import run_ranks
from tests.helpers.runs import losses, resumes, train
from toolkit.config import ConfigError, validate
from toolkit.families.tiny import TINY, TINY_MOE, tiny_config, tiny_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")

FAMILIES = ("llama", "qwen2", "gpt2")
CASES = {**{f: (f, []) for f in FAMILIES}, "llama+lm_head": ("llama", ["lm_head"])}
"""Parity cases: (family, lora.modules_to_save); the last trains the (untied) LM head in full."""


def plan_for(family_or_dir, **lora):
    from toolkit.plan import build_plan
    hf = tiny_config(family_or_dir)
    cfg = validate({"lora": {"rank": RANK, **lora}, "train": {"global_batch_size": 4, "micro_batch_size": 1}})
    return build_plan(cfg, [1], hf_config=hf)


# --- names, checked in the plan (fast) -----------------------------------------------------------

def test_bad_target_is_refused_naming_the_valid_modules():
    with pytest.raises(ConfigError, match=r"no module of this model is named 'q_proj'; valid names: c_attn, c_fc, "
                                          r"c_proj \(or all-linear\)"):
        plan_for("gpt2", target_modules=["q_proj"])
    with pytest.raises(ConfigError, match="'lm_head' matches lm_head, the output layer"):
        plan_for("llama", target_modules=["lm_head"])
    with pytest.raises(ConfigError, match="tied embedding"):
        plan_for("qwen2", modules_to_save=["lm_head"])


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_moe_router_is_never_adapted_and_packed_experts_are_refused(family):
    spec = plan_for(family).lora
    assert not any("gate" == t or t.endswith("_gate") for t in spec.targets), spec.targets
    with pytest.raises(ConfigError, match="an MoE gate \\(router\\), which LoRA never adapts"):
        plan_for(family, target_modules=["gate"])
    with pytest.raises(ConfigError, match="routed experts that transformers packs as 3-D parameters"):
        plan_for(family, target_modules=["down_proj"])


@pytest.mark.parametrize("family", sorted({**TINY, **TINY_MOE}))  # every family: a new one by being added
def test_planned_trainable_count_is_peft_s(family):
    """The plan's count (estimate, dry-run, metrics) against peft's own count on the wrapped model."""
    from toolkit.lora.peft import apply_lora
    plan = plan_for(family)
    model = apply_lora(tiny_model(family), plan.lora, seed=1)
    trainable, _ = model.get_nb_trainable_parameters()
    assert trainable == plan.lora.trainable == plan.trainable_parameters()[0]


def _layer_forwards_and_grads(checkpointing: bool, lora: bool) -> tuple[float, dict[str, torch.Tensor]]:
    """The toolkit's HF model of tiny llama (``adapters/hf.build_model``, with adapters if ``lora``),
    one training forward and backward: attention forwards per decoder layer, and the gradients."""
    from toolkit.adapters.hf import build_model
    from toolkit.lora.peft import apply_lora
    from toolkit.plan import build_plan
    cfg = validate({"model": {"activation_checkpointing": checkpointing}, "lora": {"rank": RANK} if lora else {}})
    plan = build_plan(cfg, [1], hf_config=tiny_config("llama"))
    model = build_model(plan)
    model = apply_lora(model, plan.lora, seed=1) if lora else model
    layers = model.get_submodule("base_model.model.model.layers" if lora else "model.layers")
    calls = []
    for layer in layers:  # the layer's own hook does not see a recompute: it stops at the last saved tensor
        layer.self_attn.register_forward_hook(lambda *_: calls.append(1))
    [mb] = batches(model.config.vocab_size, n_micro=1, mbs=2)
    model.train()(input_ids=mb["input_ids"], labels=mb["labels"]).loss.backward()
    return len(calls) / len(layers), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_activation_checkpointing_is_applied(lora):
    """``model.activation_checkpointing=true`` recomputes every decoder layer in backward (each runs
    twice per forward and backward; once without) and changes no gradient. With the checkpointing
    branch of ``adapters/hf.py`` removed every other recompute test passed (they only assert that
    nothing changes); this one counts 1 forward (mutated once)."""
    plain, want = _layer_forwards_and_grads(False, lora)
    recomputed, got = _layer_forwards_and_grads(True, lora)
    assert (plain, recomputed) == (1, 2)
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_estimate_counts_gradients_and_adam_state_of_the_adapters_only(stage):
    """fp32, DP 2: the frozen base holds weights only; gradients and Adam state (m, v, fp32 master
    at ZeRO 1-3) are the adapters'."""
    from toolkit.estimate.memory import memory
    from toolkit.plan import build_plan
    cfg = validate({"lora": {"rank": RANK}, "zero": {"stage": stage}})
    plan = build_plan(cfg, [2], hf_config=tiny_config("llama"))
    tau, phi, d = plan.lora.trainable, plan.model.total, 2
    mem = memory(plan.config, plan.model, plan.layout(2), lora_trainable=tau)
    sharded = d if stage >= 1 else 1
    assert mem.weights == (phi + tau) * 4 / (d if stage == 3 else 1)
    assert mem.gradients == tau * 4 / sharded
    assert mem.optimizer == (8 + (4 if stage >= 1 else 0)) * tau / sharded


# --- parity with HF + peft at ZeRO-2 and ZeRO-3 ----------------------------------------------------


def _engine_parity(rank, world, cases, stages):
    """Per (stage, family): this rank's logits and every adapter's whole gradient, after the global
    batch's micro-batches went through ``DeepSpeedEngine`` as ``train_step`` sends them."""
    import torch.distributed as dist
    results = {}
    for stage in stages:
        for case, (base_dir, modules_to_save) in cases.items():
            _, engine = seeded_lora_engine(world, base_dir, stage, modules_to_save)
            logits, grads = step_global_batch(engine, rank, world)
            results[(stage, case)] = {"logits": logits, "grads": grads}
            engine.engine.destroy()
            dist.barrier()
    return results


@pytest.fixture(scope="module")
def base_dirs(tmp_path_factory):
    return tiny_bases(tmp_path_factory.mktemp("lora_bases"), FAMILIES)


@pytest.fixture(scope="module")
def parity(base_dirs, tmp_path_factory):
    cases = {case: (base_dirs[family], save) for case, (family, save) in CASES.items()}
    return run_ranks(_engine_parity, 2, tmp_path_factory.mktemp("lora_parity"), cases, (2, 3), timeout=600)


@pytest.mark.parametrize("stage", [2, 3])
@pytest.mark.parametrize("case", CASES)
def test_logits_and_adapter_grads_equal_hf_peft(case, stage, parity, base_dirs):
    family, modules_to_save = CASES[case]
    micro = batches(tiny_config(family).vocab_size)
    ref_logits, ref_grads = reference(base_dirs[family], micro, modules_to_save)
    logit_gap = max((a - b).abs().max().item() for r, res in enumerate(parity)
                    for a, b in zip(res[(stage, case)]["logits"], ref_logits[r * 2:(r + 1) * 2]))
    assert_adapters_match_peft(f"{case} ZeRO-{stage}", logit_gap, parity[0][(stage, case)]["grads"], ref_grads)


# --- training, checkpoints and exports through `toolkit train` -------------------------------------


RUNS = {"zero2": ["zero.stage=2"],
        "zero3": ["zero.stage=3", "lora.modules_to_save=[lm_head]"],  # the LM head trained in full too
        "zero0": ["zero.stage=0"],
        "zero3_offload": ["zero.ds_config=zero3_offload"],  # DeepSpeedCPUAdam on the host
        "zero2_recompute": ["zero.stage=2", "model.activation_checkpointing=true"],  # adapters inside recomputed layers
        "zero2_bf16": ["zero.stage=2", "model.dtype=bf16"],
        "zero2_decay_clip": ["zero.stage=2", *DECAY_CLIP],
        "zero3_random": ["zero.stage=3", "model.init=random"]}  # the base exists only in the engine
"""LoRA runs of the demo base through ``toolkit train``, each trained once per module."""


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory, data_cache, demo_base):
    return trained_once(tmp_path_factory.mktemp("lora_runs"), data_cache, demo_base, RUNS)


@pytest.mark.slow
def test_weight_decay_and_clipping_act_on_the_adapters_as_in_a_peft_adamw_loop(lora_runs, demo_base, data_cache):
    check_decay_and_clip_against_peft(lora_runs("zero2_decay_clip"), demo_base, data_cache, "ZeRO-2")


@pytest.mark.slow
@pytest.mark.parametrize("run", [r for r in RUNS if not any(k in r for k in ("bf16", "decay", "random"))])
def test_losses_equal_a_single_process_peft_adamw_loop(run, lora_runs, demo_base, data_cache):
    save = ["lm_head"] if "lora.modules_to_save=[lm_head]" in RUNS[run] else []
    got, want = losses(lora_runs(run)), reference_losses(demo_base, data_cache, save)
    gap = max(abs(a - b) / b for a, b in zip(got, want))
    frozen = reference_losses(demo_base, data_cache, save, lr_scale=0.0)  # the adapters never updated
    moved = max(abs(a - b) / b for a, b in zip(want, frozen))
    print(f"\n{run} LoRA losses vs HF + peft + AdamW: max relative gap {gap:.2e} "
          f"(training moved them {moved:.2e} from the untrained adapters')")
    assert len(got) == 6 and moved > 100 * LOSS_RTOL  # the test can tell an update from none
    assert got == pytest.approx(want, rel=LOSS_RTOL)


@pytest.mark.slow
def test_trainable_count_is_printed_and_recorded(lora_runs):
    rows = [json.loads(x) for x in (lora_runs("zero2") / "metrics.jsonl").read_text().splitlines()]
    [record] = [r for r in rows if r.get("event") == "parameters"]
    plan = json.loads((lora_runs("zero2") / "plan.json").read_text())
    assert record["trainable_params"] == plan["lora"]["trainable"] > 0
    assert record["total_params"] == plan["model"]["embedding"] + plan["model"]["output"] + sum(
        plan["model"]["per_layer"]) + plan["model"]["other"] + record["trainable_params"]


@pytest.mark.slow
def test_checkpoint_holds_adapters_only_and_names_its_base(lora_runs, demo_base):
    ckpt = lora_runs("zero2") / "checkpoints" / "step_00000006"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["lora"]["rank"] == RANK and meta["base_model"]["path"] == str(demo_base)
    assert meta["base_model"]["fingerprint"].startswith("sha256:")
    states = torch.load(ckpt / "engine" / "global_step6" / "mp_rank_00_model_states.pt", weights_only=False)
    saved = set(states["module"])
    assert saved and all(".lora_A." in n or ".lora_B." in n for n in saved), sorted(saved)[:5]


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_kill_9_and_resume_auto_is_bitwise_exact(stage, lora_runs, tmp_path, data_cache, demo_base):
    """Restored from an adapter-only checkpoint: adapters (and the LM head trained in full at
    ZeRO-3), their Adam moments, trainer and RNG state. Loading without the optimizer state made
    step 5 differ at ZeRO-2 (7.65600 vs 7.65734: mutated once, README)."""
    run_dir = tmp_path / "crashed"
    train(run_dir, data_cache, *LORA_RUN, f"model.name_or_path={demo_base}", *RUNS[f"zero{stage}"],
          "restart.max_restarts=1", "restart.backoff_s=0.2", env={"TOOLKIT_FAULT": "kill:step=5:rank=1"})
    assert resumes(run_dir) == [("step_00000003", 3, "as saved")]
    assert losses(run_dir) == losses(lora_runs(f"zero{stage}"))


@pytest.mark.slow
@pytest.mark.parametrize("saved,resumed", [((2, 2), (3, 1)), ((3, 2), (1, 1))], ids=["z2dp2-z3dp1", "z3dp2-z1dp1"])
def test_resume_at_another_dp_size_and_stage_goes_on_the_loss_curve(saved, resumed, tmp_path, data_cache, demo_base):
    """Saved after 2 steps at one (ZeRO stage, DP), resumed at another (the adapters resharded
    through DeepSpeed's universal layout): steps 3-6 equal the single-process peft loop's. Adam's
    moments and step go along (without them the losses move by ~1e-4: the kill -9 mutation)."""
    run_dir = tmp_path / "run"
    base = [*LORA_RUN, f"model.name_or_path={demo_base}", "checkpoint.every=2"]
    train(run_dir, data_cache, *base, f"zero.stage={saved[0]}", "train.steps=2", nproc=saved[1])
    train(run_dir, data_cache, *base, f"zero.stage={resumed[0]}", nproc=resumed[1])
    assert resumes(run_dir) == [("step_00000002", 2, "resharded")]
    got, want = losses(run_dir), reference_losses(demo_base, data_cache)
    print(f"\nZeRO-{saved[0]} DP{saved[1]} -> ZeRO-{resumed[0]} DP{resumed[1]}: max relative gap "
          f"{max(abs(a - b) / b for a, b in zip(got, want)):.2e}")
    assert got == pytest.approx(want, rel=LOSS_RTOL)
    assert not any((run_dir / "resharded").iterdir())  # the universal copy is dropped once loaded


@pytest.mark.slow
def test_resume_on_another_base_is_refused_naming_both(lora_runs, tmp_path, data_cache, demo_base):
    import shutil

    from transformers import AutoModelForCausalLM
    run_dir = tmp_path / "run"
    shutil.copytree(lora_runs("zero2") / "checkpoints", run_dir / "checkpoints")
    other = tmp_path / "other-base"
    AutoModelForCausalLM.from_pretrained(demo_base, dtype=torch.bfloat16).save_pretrained(other)
    proc = train(run_dir, data_cache, *LORA_RUN, f"model.name_or_path={other}", "train.steps=7", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr  # refused before launch
    assert "LoRA adapters trained on another base model" in proc.stderr
    assert str(demo_base) in proc.stderr and str(other) in proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("overrides,message", [
    (["lora.rank=0"], r"holds LoRA adapters only \(lora.rank=4\) and this run trains the whole model"),
    (["lora.rank=8"], r"holds other LoRA adapters \(rank: checkpoint 4, this run 8\)"),
    (["lora.target_modules=[q_proj,v_proj]"], r"holds other LoRA adapters \(targets: checkpoint \['down_proj'"),
    (["lora.modules_to_save=[lm_head]"], r"holds other LoRA adapters \(modules_to_save: checkpoint \[\], this run "
                                         r"\['lm_head'\]\)")], ids=["to-full", "rank", "targets", "modules_to_save"])
def test_resume_with_other_lora_settings_is_refused_naming_them(overrides, message, lora_runs, tmp_path, data_cache,
                                                                 demo_base):
    import re
    import shutil
    run_dir = tmp_path / "run"
    shutil.copytree(lora_runs("zero2") / "checkpoints", run_dir / "checkpoints")
    proc = train(run_dir, data_cache, *LORA_RUN, f"model.name_or_path={demo_base}", "train.steps=7", *overrides,
                 check=False)
    assert proc.returncode == 2 and re.search(message, proc.stderr), proc.stderr[-2000:]  # refused before launch


def test_a_full_checkpoint_never_resumes_as_lora_and_back(tmp_path):
    """``check_same_lora`` on a full fine-tuning checkpoint's meta.json (no ``lora``) with a LoRA
    run, and the other way round: refused naming the fix."""
    from toolkit.checkpoint.reshard import check_same_lora
    from toolkit.storage.rundir import RunDirError
    spec = {"rank": 4, "targets": ["q_proj"], "modules_to_save": []}
    with pytest.raises(RunDirError, match=r"is a full fine-tuning checkpoint and this run trains LoRA adapters "
                                           r"\(lora.rank=4\); to fine-tune that model with LoRA, export it"):
        check_same_lora(tmp_path, {"layout": {}}, spec, {"fingerprint": "sha256:x"})
    with pytest.raises(RunDirError, match=r"holds LoRA adapters only \(lora.rank=4\) and this run trains the whole"):
        check_same_lora(tmp_path, {"lora": spec, "base_model": {"fingerprint": "sha256:x"}}, None, None)
    check_same_lora(tmp_path, {"layout": {}}, None, None)  # full on full: nothing to check here


@pytest.mark.slow
def test_converter_refuses_a_changed_base_and_a_zero_0_checkpoint(lora_runs, demo_base, tmp_path):
    """``--to hf`` merges onto a base only if its fingerprint is meta.json's (a base re-saved in bf16
    is refused, naming both fingerprints; the fingerprint hashes the files' headers, not the
    weights: ``storage/meta.base_model_record``); a ZeRO-0 LoRA checkpoint (no partitioned
    optimizer files to read) is refused pointing at the run's exports."""
    from transformers import AutoModelForCausalLM

    from toolkit.convert import ConvertError, convert
    changed = tmp_path / "changed-base"
    AutoModelForCausalLM.from_pretrained(demo_base, dtype=torch.bfloat16).save_pretrained(changed)
    with pytest.raises(ConvertError, match=rf"the base {changed} has fingerprint sha256:\w+, the adapters were trained "
                                           rf"on sha256:\w+ \({demo_base}\); merging onto another base would be wrong"):
        convert(lora_runs("zero2"), tmp_path / "hf", to="hf", base=str(changed))
    assert not (tmp_path / "hf").exists()
    with pytest.raises(ConvertError, match="the ZeRO reader reads stages 1-3; this LoRA checkpoint was written at "
                                           ".*'zero_stage': 0.*; use its run's adapter/ and hf_final/"):
        convert(lora_runs("zero0"), tmp_path / "peft", to="peft")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_adapter_export_loads_in_peft_and_merges_to_hf_final(stage, lora_runs, demo_base):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    run_dir = lora_runs(f"zero{stage}")
    merged_file = load_file(run_dir / "hf_final" / "model.safetensors")
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(demo_base, dtype=torch.float32),
                                           run_dir / "adapter").eval()
    ids = torch.randint(1, 2048, (2, 24), generator=torch.Generator().manual_seed(5))
    hf_final = AutoModelForCausalLM.from_pretrained(run_dir / "hf_final", dtype=torch.float32).eval()
    with torch.no_grad():
        gap = (peft_model(input_ids=ids).logits - hf_final(input_ids=ids).logits).abs().max().item()
        merged = peft_model.merge_and_unload().state_dict()
    print(f"\nZeRO-{stage}: adapter (peft) vs hf_final logits: max gap {gap:.2e}")
    assert gap <= EXPORT_LOGIT_TOL
    assert sorted(merged_file) == sorted(merged)
    differs = [n for n, t in merged_file.items() if not torch.equal(t, merged[n])]
    assert not differs, differs[:5]
    assert any("lora" not in n and not torch.equal(merged_file[n], load_file(demo_base / "model.safetensors")[n])
               for n in merged_file)  # the merge changed the adapted weights


@pytest.mark.slow
def test_random_init_base_exports_peft_s_merge(lora_runs):
    check_random_init_export(lora_runs("zero3_random"))


@pytest.mark.slow
def test_bf16_run_exports_its_fp32_masters_merged_onto_the_base_as_stored(lora_runs, demo_base, tmp_path):
    """A bf16 run's module holds rounded copies of the base and the adapters: hf_final/ must merge
    the optimizer's fp32 masters onto the base as its files store it (every weight the run did not
    adapt equals the base's bit for bit), as the converter does from the checkpoint, and adapter/
    must hold the masters, not their bf16 roundings."""
    from safetensors.torch import load_file

    from toolkit.convert import convert
    run = lora_runs("zero2_bf16")
    convert(run, tmp_path / "hf", to="hf")
    convert(run, tmp_path / "peft", to="peft")
    final, base = load_file(run / "hf_final" / "model.safetensors"), load_file(demo_base / "model.safetensors")
    untouched = [n for n in base if "proj" not in n]  # all-linear adapts every *_proj
    assert untouched and all(torch.equal(final[n], base[n]) for n in untouched)
    for got, want in ((final, load_file(tmp_path / "hf" / "model.safetensors")),
                      (load_file(run / "adapter" / "adapter_model.safetensors"),
                       load_file(tmp_path / "peft" / "adapter_model.safetensors"))):
        assert sorted(got) == sorted(want) and [n for n in want if not torch.equal(got[n], want[n])] == []
    adapter = load_file(run / "adapter" / "adapter_model.safetensors")
    assert any(not torch.equal(t, t.bfloat16().float()) for t in adapter.values())  # masters, not bf16 copies
    assert peft_merge_gaps(run, demo_base) == []  # an independent merge: peft's


def test_dry_run_shows_the_resolved_lora_and_its_trainable_count(tmp_path, data_cache):
    from tests.helpers.runs import run_in_process, train_args
    proc = run_in_process([*train_args(tmp_path / "r", data_cache, "lora.rank=4"), "--dry-run"])
    # the demo Llama (hidden 128, K/V 64, MLP 352, 4 layers): 4 x (256 + 192 + 192 + 256 + 3 x 480) per layer
    assert '"targets": [\n    "down_proj",' in proc.stdout and '"trainable": 37376' in proc.stdout
    assert "trainable: 37,376 parameters (LoRA adapters; the base is frozen" in proc.stdout


@pytest.mark.slow
def test_inspect_describes_adapters_and_convert_refuses_them_by_name(lora_runs):
    from toolkit.convert import ConvertError, inspect
    from toolkit.formats.detect import open_source
    run = lora_runs("zero2")
    ckpt, peft_dir = inspect(run), inspect(run / "adapter")
    plan = json.loads((run / "plan.json").read_text())["lora"]
    for info in (ckpt, peft_dir):
        assert (info["rank"], info["alpha"], info["trainable_params"]) == (RANK, ALPHA, plan["trainable"])
        assert sorted(info["targets"]) == plan["targets"]
    assert ckpt["step"] == 6 and ckpt["complete"] and ckpt["format"] == "toolkit-deepspeed (LoRA adapters only)"
    assert peft_dir["format"] == "peft" and peft_dir["dtypes"] == ["F32"]
    with pytest.raises(ConvertError, match="a LoRA checkpoint \\(adapters only, base .*\\); it converts only as a "
                                           "whole: toolkit convert CKPT OUT --to peft"):
        open_source(run)
    with pytest.raises(ConvertError, match="an HF-PEFT adapter directory"):
        open_source(run / "adapter")


@pytest.mark.slow
def test_convert_lora_checkpoint_to_peft_and_merged_hf_equals_the_run_s_exports(lora_runs, tmp_path):
    """The last checkpoint (step 6, ZeRO-3, LM head trained in full) through the converter's ZeRO
    reader: --to peft equals the run's adapter/, --to hf (merged onto the base named in meta.json)
    equals its hf_final/, tensor for tensor; so does the run's adapter/ (an HF-PEFT directory) --to
    hf, merged onto the base its adapter_config.json names; --verify passes against peft."""
    from safetensors.torch import load_file

    from toolkit.convert import convert
    from toolkit.lora.convert import verify_adapter
    run = lora_runs("zero3")
    convert(run, tmp_path / "peft", to="peft")
    convert(run, tmp_path / "hf", to="hf")
    convert(run / "adapter", tmp_path / "hf_from_peft", to="hf")
    for got, want in ((tmp_path / "peft" / "adapter_model.safetensors", run / "adapter" / "adapter_model.safetensors"),
                      (tmp_path / "hf" / "model.safetensors", run / "hf_final" / "model.safetensors"),
                      (tmp_path / "hf_from_peft" / "model.safetensors", run / "hf_final" / "model.safetensors")):
        got, want = load_file(got), load_file(want)
        assert sorted(got) == sorted(want)
        assert [n for n in want if not torch.equal(got[n], want[n])] == []
    for src, dst in ((run, tmp_path / "hf"), (run, tmp_path / "peft"), (run / "adapter", tmp_path / "hf_from_peft")):
        report = verify_adapter(src, dst, None)
        assert report.ok and report.tensors and report.logits_max_diff is not None, report.lines()


@pytest.mark.slow
def test_verify_fails_on_a_destination_that_is_not_the_source_s(lora_runs, tmp_path):
    """``--verify`` of a LoRA conversion (ZeRO-2 run, step 6) against damaged destinations, each
    refused naming the tensor: an HF-PEFT DST with one entry changed, or one tensor too many; a
    merged HF DST with one weight changed, or one tensor too many (transformers skips it on load:
    ``verify_adapter`` passed it before it read the names from the files, mutated once); a ZeRO and a
    megatron checkpoint of another run's adapters (``compare_lora_sources``, the --to zero/megatron
    check)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from toolkit.convert import convert
    from toolkit.lora.checkpoint import compare_lora_sources, open_lora_checkpoint
    from toolkit.lora.convert import verify_adapter
    run, other = lora_runs("zero2"), lora_runs("zero2_decay_clip")  # the same lora.* settings, other adapters
    convert(run, tmp_path / "peft", to="peft")
    convert(run, tmp_path / "hf", to="hf")

    def damaged(kind: str, file: str, edit) -> Path:
        out = tmp_path / f"{kind}_{edit.__name__}"
        shutil.copytree(tmp_path / kind, out)
        tensors = load_file(out / file)
        edit(tensors)
        save_file(tensors, out / file, metadata={"format": "pt"})
        return out

    def changed(tensors):
        name = sorted(tensors)[0]
        tensors[name] = tensors[name].clone()
        tensors[name].view(-1)[0] += 1e-3

    def extra(tensors):
        tensors["base_model.model.model.layers.0.mlp.extra.weight" if "base_model.model.model.layers.0.self_attn.q_proj"
                ".lora_A.weight" in tensors else "model.layers.0.mlp.extra.weight"] = torch.ones(2, 2)

    cases = {("peft", changed): "layers.0.mlp.down_proj.lora_A",  # the first name of each file
             ("peft", extra): "unexpected ['base_model.model.model.layers.0.mlp.extra",
             ("hf", changed): "lm_head.weight", ("hf", extra): "model.layers.0.mlp.extra.weight (only in DST)"}
    for (kind, edit), named in cases.items():
        file = "adapter_model.safetensors" if kind == "peft" else "model.safetensors"
        report = verify_adapter(run, damaged(kind, file, edit), None)
        print(f"\n{kind} {edit.__name__}: {report.lines()[0][:160]}")
        assert not report.ok and report.lines()[-1] == "verify: MISMATCH", (kind, edit.__name__)
        assert any(named in m for m in report.mismatched), report.mismatched
    for to, extra_args in (("zero", {}), ("megatron", {"tp": 2})):
        convert(other, tmp_path / f"other_{to}", to=to, **extra_args)
        report = compare_lora_sources(open_lora_checkpoint(run), open_lora_checkpoint(tmp_path / f"other_{to}"))
        print(f"\nanother run's adapters as {to}: {report.lines()[0][:120]}")
        assert not report.ok and len(report.mismatched) >= report.tensors > 0


def test_the_worked_example_plans(demo_base, tmp_path):
    """examples/lora/config.yaml validates and resolves (its base, the demo's hf_final, stands in)."""
    from tests.helpers.runs import REPO, run_in_process
    proc = run_in_process(["train", str(REPO / "examples" / "lora" / "config.yaml"), "--run-dir", str(tmp_path / "r"),
                           "--set", f"model.name_or_path={demo_base}", "--dry-run"])
    assert '"rank": 8' in proc.stdout and '"targets": [\n    "down_proj",' in proc.stdout, proc.stdout[-2000:]

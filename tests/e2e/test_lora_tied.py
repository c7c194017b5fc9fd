"""LoRA on a base whose input and output embeddings are tied (as most small published checkpoints
are), end to end through the CLI. Every other LoRA training run in the suite adapts the untied demo
base; a ZeRO-3 LoRA checkpoint of a tied model could not be converted at all (DeepSpeed lists the tie
in ``shared_params`` though ``exclude_frozen_parameters`` left the tied embedding out: KeyError in
``zero_index._add_shared``), nor resumed at another DP size or stage (the reshard reads it the same way).

One ZeRO-3 DP2 run of the tied demo Llama (4 steps, checkpoints at 2 and 4) is shared by the module:
- its checkpoint converts ``--to peft`` / ``--to hf`` with ``--verify``; the adapters read equal
  DeepSpeed's own ``zero_to_fp32`` bit for bit, the peft directory is the run's own ``adapter/``, the
  merged model is peft's ``merge_and_unload()`` and its HF forward (head still tied) gives peft's logits;
- step 2 resumes at DP1 ZeRO-1 (resharded on load) and, converted ``--to megatron --tp 2``, on
  megatron TP2, both continuing the run's losses; the checkpoints those runs write (ZeRO-1 native,
  megatron torch_dist) convert ``--to peft`` / ``--to hf`` / ``--to zero`` and verify.
A second short ZeRO-1 run trains a module in full beside the adapters (``lora.modules_to_save``; a
tied embedding is refused, the norms are not), converts to peft / hf / zero, and is refused
``--to megatron`` by name.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.runs import losses, resumes, run_in_process, train
from toolkit.lora.peft import ADAPTER

pytestmark = [pytest.mark.slow, pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")]

K, STEPS = 2, 4
LORA = ["lora.rank=4", "lora.alpha=8.0", "model.init=pretrained", f"train.steps={STEPS}", f"checkpoint.every={K}"]
LOSS_RTOL = 1e-6
"""Resumed steps vs the uninterrupted run: measured 1.6e-8 (DP1 ZeRO-1) and 1.6e-8 (megatron TP2)."""
LOGIT_TOL = 5e-6
"""The merged model's HF forward vs peft's unmerged one (tests/helpers/lora.py's EXPORT_LOGIT_TOL); measured 8.3e-7."""


def ckpt(run, step: int):
    return run / "checkpoints" / f"step_{step:08d}"


@pytest.fixture(scope="module")
def tied_base(tmp_path_factory):
    """The demo's tiny Llama with ``tie_word_embeddings=true`` and HF's init (seed 0), saved as a base."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.config import DEMO_DIR
    path = tmp_path_factory.mktemp("tied_base") / "base"
    config = AutoConfig.from_pretrained(DEMO_DIR / "tiny-llama")
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory, data_cache, tied_base):
    """``get(name)``: a LoRA run of the tied base, trained on first use."""
    root, cache = tmp_path_factory.mktemp("lora_tied"), {}
    overrides = {"zero3": ["zero.stage=3"],
                 "zero1_norm": ["zero.stage=1", "lora.modules_to_save=[norm]", f"train.steps={K}"]}

    def get(name: str):
        if name not in cache:
            cache[name] = root / name
            train(cache[name], data_cache, *LORA, f"model.name_or_path={tied_base}", *overrides[name])
        return cache[name]
    return get


def cli_convert(src, dst, *args: str) -> str:
    proc = run_in_process(["convert", str(src), str(dst), *args, "--verify"])
    assert "verify: OK" in proc.stdout, proc.stdout[-3000:]
    return proc.stdout


def load(path):
    from safetensors.torch import load_file
    return load_file(path / ("adapter_model.safetensors" if (path / "adapter_config.json").is_file() else
                             "model.safetensors"))


def assert_equal(got: dict, want: dict):
    assert sorted(got) == sorted(want)
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


def test_zero3_checkpoint_reads_as_deepspeed_reads_it(runs):
    """The converter's reader against DeepSpeed's ``zero_to_fp32`` (which skips the dangling tie)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    from toolkit.lora.checkpoint import open_lora_checkpoint
    step = ckpt(runs("zero3"), STEPS)
    ours = open_lora_checkpoint(step)
    want = get_fp32_state_dict_from_zero_checkpoint(str(step / "engine"), exclude_frozen_parameters=True)
    assert len(want) == 56 and ours.step == STEPS and ours.has_optimizer  # 4 layers x 7 projections x (A, B)
    assert_equal(ours.trained(), want)


def test_zero3_checkpoint_to_peft_and_hf_is_what_peft_makes(runs, tied_base, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    run = runs("zero3")
    cli_convert(ckpt(run, STEPS), tmp_path / "peft", "--to", "peft")
    cli_convert(ckpt(run, STEPS), tmp_path / "hf", "--to", "hf")
    assert_equal(load(tmp_path / "peft"), load(run / "adapter"))  # the run's own export, from its engine

    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tied_base), tmp_path / "peft").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # still tied after the merge
    ids = torch.randint(0, merged.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want_logits, got_logits = peft_model(input_ids=ids).logits, merged(input_ids=ids).logits
    want = peft_model.merge_and_unload().state_dict()
    want.pop("lm_head.weight")  # the tied head is the embedding: saved once, as HF saves it
    assert_equal(load(tmp_path / "hf"), want)
    gap = (got_logits - want_logits).abs().max().item()
    print(f"\ntied ZeRO-3 LoRA --to hf: HF forward vs peft's unmerged forward, max |diff| {gap:.1e}")
    assert gap <= LOGIT_TOL


def resume_from(run_dir, tmp_path, data_cache, tied_base, *target: str, nproc: int = 2, convert_to=()):
    """A new run that resumes from ``run_dir``'s step-K checkpoint (copied, or converted with
    ``convert_to``) at another layout; (its losses, the uninterrupted run's, its run dir)."""
    resumed = tmp_path / "resumed"
    if convert_to:
        cli_convert(ckpt(run_dir, K), ckpt(resumed, K), *convert_to)
    else:
        shutil.copytree(ckpt(run_dir, K), ckpt(resumed, K))
    train(resumed, data_cache, *LORA, f"model.name_or_path={tied_base}", *target, "resume=auto", nproc=nproc)
    full, got = losses(run_dir), losses(resumed)
    gap = max(abs(a - b) / b for a, b in zip(got, full[K:]))
    print(f"\nresumed at {target}: steps {K + 1}-{STEPS} vs the uninterrupted run: max relative gap {gap:.1e}")
    assert len(full) == STEPS and got == pytest.approx(full[K:], rel=LOSS_RTOL)
    return resumed


def test_zero3_dp2_checkpoint_resumes_at_dp1_zero1_and_its_checkpoint_converts(runs, tmp_path, data_cache, tied_base):
    resumed = resume_from(runs("zero3"), tmp_path, data_cache, tied_base, "zero.stage=1", nproc=1)
    assert [r[2] for r in resumes(resumed)] == ["resharded"]
    written = ckpt(resumed, STEPS)  # native ZeRO-1, DP1: the stage 1/2 reader
    cli_convert(written, tmp_path / "peft", "--to", "peft")
    cli_convert(written, tmp_path / "hf", "--to", "hf")
    cli_convert(written, tmp_path / "zero3", "--to", "zero", "--dp", "2", "--zero-stage", "3")
    assert_equal(load(tmp_path / "peft"), load(resumed / "adapter"))
    assert_equal(load(tmp_path / "hf"), load(resumed / "hf_final"))


def test_zero3_checkpoint_resumes_on_megatron_tp2_and_its_checkpoint_converts(runs, tmp_path, data_cache, tied_base):
    tp2 = ["backend=megatron", "megatron.tp=2"]
    resumed = resume_from(runs("zero3"), tmp_path, data_cache, tied_base, *tp2,
                          convert_to=("--to", "megatron", "--tp", "2"))
    written = ckpt(resumed, STEPS)  # megatron torch_dist, TP2, of a tied model
    cli_convert(written, tmp_path / "peft", "--to", "peft")
    cli_convert(written, tmp_path / "hf", "--to", "hf")
    cli_convert(written, tmp_path / "zero", "--to", "zero", "--dp", "2", "--zero-stage", "2")
    cli_convert(written, tmp_path / "tp1", "--to", "megatron", "--tp", "1")
    assert_equal(load(tmp_path / "peft"), load(resumed / "adapter"))
    assert_equal(load(tmp_path / "hf"), load(resumed / "hf_final"))


def test_trained_norms_beside_adapters_of_a_tied_model(runs, tied_base, tmp_path):
    """``lora.modules_to_save=[norm]``: peft matches modules to save by plain suffix, so every
    ``*_layernorm`` trains too (the plan counted only ``model.norm``: the ranks refused to start,
    38,528 trainable where the plan counted 37,504); converts to peft / hf / zero, refused ``--to
    megatron`` (which trains only the embedding and LM head in full) with the fix named."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    run = runs("zero1_norm")
    plan = json.loads((run / "plan.json").read_text())["lora"]
    trained = load(run / "adapter")
    norms = [n for n in trained if "norm" in n]
    assert len(norms) == 1 + 2 * 4 and plan["trainable"] == sum(t.numel() for t in trained.values())
    cli_convert(ckpt(run, K), tmp_path / "peft", "--to", "peft")
    cli_convert(ckpt(run, K), tmp_path / "hf", "--to", "hf")
    cli_convert(ckpt(run, K), tmp_path / "zero", "--to", "zero", "--dp", "1", "--zero-stage", "3")
    assert_equal(load(tmp_path / "peft"), trained)
    want = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tied_base), tmp_path / "peft")
    want = want.merge_and_unload().state_dict()
    want.pop("lm_head.weight")
    assert_equal(load(tmp_path / "hf"), want)
    refused = run_in_process(["convert", str(ckpt(run, K)), str(tmp_path / "m"), "--to", "megatron"], check=False)
    assert refused.returncode != 0 and "modules_to_save" in refused.stderr and "--to zero, peft or hf" in refused.stderr
    assert not (tmp_path / "m").exists()


def test_plan_counts_modules_to_save_as_peft_matches_them_and_refuses_a_tied_embedding(tied_base):
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.config import ConfigError, validate
    from toolkit.lora.peft import peft_config
    from toolkit.plan import build_plan
    config = AutoConfig.from_pretrained(tied_base)

    def plan(saved, backend="deepspeed"):
        cfg = validate({"lora": {"rank": 4, "modules_to_save": saved}, "model": {"name_or_path": str(tied_base)},
                        "train": {"global_batch_size": 4, "micro_batch_size": 1}, "backend": backend})
        return build_plan(cfg, [1], hf_config=config).lora
    spec = plan(["norm"])
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tied_base), peft_config(spec))
    assert spec.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad) == 37_376 + 9 * 128
    assert any(f"input_layernorm.modules_to_save.{ADAPTER}" in n for n, _ in model.named_parameters())
    for name in ("embed_tokens", "lm_head"):
        with pytest.raises(ConfigError, match=f"lora.modules_to_save: '{name}' is a tied embedding"):
            plan([name])
    # megatron trains only the embedding and LM head in full: 'norm' crashed its ranks (KeyError
    # 'modules_to_save.default.weight'), 'model.norm' trained the final norm unannounced
    for name, hit in (("norm", "model.layers.0.input_layernorm.weight"), ("model.norm", "model.norm.weight")):
        with pytest.raises(ConfigError, match=f"'{name}' on megatron: only the embedding and the LM head .* "
                                              f"\\(peft would train {hit}"):
            plan([name], backend="megatron")


def test_a_peft_adapter_training_a_tied_embedding_is_refused_as_a_resumable_checkpoint(tied_base, tmp_path):
    """An HF-PEFT adapter that trains a tied embedding in full (``modules_to_save=[embed_tokens]``)
    converted ``--to zero`` / ``--to megatron`` (a step-0 LoRA checkpoint) is refused naming the tie
    and ``--to hf``: the plan refuses that setting, so no run could resume the checkpoint. The
    converter resolved it on its own skeleton, built untied, and wrote the checkpoint anyway."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from toolkit.convert import ConvertError, convert
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tied_base),
                           LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"], modules_to_save=["embed_tokens"]))
    model.save_pretrained(tmp_path / "adapter")
    for to in ("zero", "megatron"):
        with pytest.raises(ConvertError, match=r"lora.modules_to_save: 'embed_tokens' is a tied embedding.*"
                                               r"convert it --to hf"):
            convert(tmp_path / "adapter", tmp_path / to, to=to, base=str(tied_base))
        assert not (tmp_path / to).exists()

"""QLoRA (``model.quantize``) through ``toolkit train``: a ZeRO-3 run on 2 ranks of the demo base in nf4 with
activation checkpointing and eval on, its checkpoints and their resumes; the bad inputs refused before
anything starts (parity with transformers + bitsandbytes + peft: tests/distributed/test_qlora.py).

- the checkpoint holds the adapters only (no quant state), and meta.json records the quantization; it
  converts ``--to peft`` (the run's adapter/); ``--to hf`` (a merge onto the full-precision files) is refused
  without ``--base``, and with it equals peft's merge and prints the logit movement from hf_final/; ``--to
  megatron`` holds the same adapters for the unquantized base and says so;
- kill -9 at step 5 and ``--resume auto``: the losses are the uninterrupted run's, bit for bit;
- the ZeRO-3 DP2 checkpoint resumes at ZeRO-2 DP1 (resharded) on the loss curve;
- a resume with another model.quantize is refused naming both; ``model.quantize`` without LoRA, on
  megatron, with an unsupported dtype, on a Conv1D model: exit 2 naming the key and the fix.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.lora import LORA_RUN
from tests.helpers.runs import losses, refused, resumes, run_in_process, train

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")

QLORA = [*LORA_RUN, "model.quantize=nf4", "zero.stage=3", "model.activation_checkpointing=true",
         "train.eval_every=2"]
LOSS_RTOL = 1e-6
"""ZeRO-3 DP2 -> ZeRO-2 DP1 resumed steps vs the uninterrupted run: measured 4.6e-8."""


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, data_cache, demo_base):
    run_dir = tmp_path_factory.mktemp("qlora") / "run"
    train(run_dir, data_cache, *QLORA, f"model.name_or_path={demo_base}")
    return run_dir


@pytest.mark.slow
def test_checkpoint_holds_the_adapters_and_records_the_quantization(qlora_run):
    ckpt = qlora_run / "checkpoints" / "step_00000006"
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["base_model"]["quantization"] == {"method": "bitsandbytes", "quant_type": "nf4", "double_quant": True,
                                                  "blocksize": 64, "storage_dtype": "fp32", "compute_dtype": "fp32"}
    states = torch.load(ckpt / "engine" / "global_step6" / "zero_pp_rank_0_mp_rank_00_model_states.pt",
                        weights_only=False)
    saved = set(states["module"])
    assert saved and all(".lora_A." in n or ".lora_B." in n for n in saved), sorted(saved)[:5]
    assert (qlora_run / "adapter" / "bnb_config.json").is_file() and (qlora_run / "hf_final").is_dir()


@pytest.mark.slow
def test_checkpoint_converts_to_peft_and_merges_only_onto_a_base_named_by_flag(qlora_run, tmp_path, demo_base):
    """``--to peft``: the run's own adapter/. ``--to hf`` alone would merge onto the unquantized files (another
    function than the one trained): refused, naming --base PATH, hf_final/ and --to peft. With ``--base``: the
    written model is peft's merge of adapter/ onto that base (bit for bit), and the printed logit movement is
    the gap between its logits and hf_final/'s (the trained function) on the probe batch, computed here."""
    import re

    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from toolkit.lora.convert import probe_ids
    ckpt = qlora_run / "checkpoints" / "step_00000006"
    run_in_process(["convert", str(ckpt), str(tmp_path / "peft"), "--to", "peft"])
    got, want = (load_file(d / "adapter_model.safetensors") for d in (tmp_path / "peft", qlora_run / "adapter"))
    assert sorted(got) == sorted(want) and all(torch.equal(got[n], want[n]) for n in want)
    code, _, err = refused(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf"])
    assert code == 2 and "nf4-quantized base" in err and "--base PATH" in err and "hf_final/" in err, err
    assert not (tmp_path / "hf").exists()

    out = run_in_process(["convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf", "--base", str(demo_base)]).stdout
    base = AutoModelForCausalLM.from_pretrained(demo_base, dtype=torch.float32)
    peft_merge = PeftModel.from_pretrained(base, qlora_run / "adapter").merge_and_unload().eval()
    written, final = (AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
                      for d in (tmp_path / "hf", qlora_run / "hf_final"))
    merged_state, written_state = peft_merge.state_dict(), written.state_dict()
    assert sorted(merged_state) == sorted(written_state)
    assert [n for n in merged_state if not torch.equal(merged_state[n], written_state[n])] == []
    ids = probe_ids(written.config.vocab_size)
    with torch.no_grad():
        moved, trained = written(input_ids=ids).logits, final(input_ids=ids).logits
        assert torch.equal(moved, peft_merge(input_ids=ids).logits)
    gap = (moved - trained).abs()
    printed = re.search(r"max \|diff\|/max \|logit\| (\S+), mean \|diff\|/mean \|logit\| (\S+)", out)
    assert printed and "nf4 base dequantized + adapters" in out, out
    want_max, want_mean = float(gap.max() / trained.abs().max()), float(gap.mean() / trained.abs().mean())
    print(f"QLoRA --to hf --base: printed {printed.groups()}, computed {want_max:.3e} {want_mean:.3e}")
    assert want_max > 0  # nf4 moves the base: a zero gap would mean hf_final/ is not the quantized function
    assert float(printed[1]) == pytest.approx(want_max, rel=2e-3) and float(printed[2]) == pytest.approx(
        want_mean, rel=2e-3)  # printed to 4 significant digits


@pytest.mark.slow
def test_checkpoint_converts_to_megatron_as_adapters_of_the_unquantized_base(qlora_run, tmp_path, demo_base):
    """``--to megatron --tp 2``: megatron-core has no 4-bit base, so the checkpoint holds the adapters for the
    unquantized base, says so on the command line, records it (no ``quantization``, the trained one as
    ``trained_on_quantization``); its adapters, read back ``--to peft``, are the run's adapter/ bit for bit."""
    from safetensors.torch import load_file

    from toolkit.checkpoint.reshard import check_same_lora
    from toolkit.storage.meta import base_model_record
    from toolkit.storage.rundir import RunDirError
    ckpt, mega = qlora_run / "checkpoints" / "step_00000006", tmp_path / "megatron"
    out = run_in_process(["convert", str(ckpt), str(mega), "--to", "megatron", "--tp", "2"]).stdout
    assert "trained on a nf4-quantized base" in out and "for the unquantized base" in out, out
    meta = json.loads((mega / "meta.json").read_text())
    base = meta["base_model"]
    assert "quantization" not in base and base["trained_on_quantization"]["quant_type"] == "nf4", base
    # the resume check of a megatron run on that base (unquantized: megatron refuses model.quantize) passes
    unquantized = base_model_record(str(demo_base), "pretrained", 0)
    check_same_lora(mega, meta, meta["lora"], unquantized)
    with pytest.raises(RunDirError, match="unquantized"):
        check_same_lora(ckpt, json.loads((ckpt / "meta.json").read_text()), meta["lora"], unquantized)
    run_in_process(["convert", str(mega), str(tmp_path / "peft"), "--to", "peft"])
    got, want = (load_file(d / "adapter_model.safetensors") for d in (tmp_path / "peft", qlora_run / "adapter"))
    assert sorted(got) == sorted(want) and [n for n in want if not torch.equal(got[n], want[n])] == []


@pytest.mark.slow
def test_kill_9_and_resume_auto_is_bitwise_exact(qlora_run, tmp_path, data_cache, demo_base):
    run_dir = tmp_path / "crashed"
    train(run_dir, data_cache, *QLORA, f"model.name_or_path={demo_base}", "restart.max_restarts=1",
          "restart.backoff_s=0.2", env={"TOOLKIT_FAULT": "kill:step=5:rank=1"})
    assert resumes(run_dir) == [("step_00000003", 3, "as saved")]
    assert losses(run_dir) == losses(qlora_run)


@pytest.mark.slow
def test_zero3_dp2_checkpoint_resumes_at_zero2_dp1(qlora_run, tmp_path, data_cache, demo_base):
    resumed = tmp_path / "resumed"
    shutil.copytree(qlora_run / "checkpoints" / "step_00000003", resumed / "checkpoints" / "step_00000003")
    train(resumed, data_cache, *QLORA, f"model.name_or_path={demo_base}", "zero.stage=2", nproc=1)
    assert [r[2] for r in resumes(resumed)] == ["resharded"]
    full, got = losses(qlora_run), losses(resumed)
    print(f"\nQLoRA ZeRO-3 DP2 -> ZeRO-2 DP1: max relative gap {max(abs(a - b) / b for a, b in zip(got, full[3:])):.1e}")
    assert len(got) == 3 and got == pytest.approx(full[3:], rel=LOSS_RTOL)
    refusal = refused(["train", "--run-dir", str(resumed), "--set", f"model.name_or_path={demo_base}",
                       *[a for s in LORA_RUN for a in ("--set", s)]])  # model.quantize=none on the nf4 checkpoint
    assert refusal[0] == 2 and "quantized as nf4" in refusal[2] and "model.quantize=none" in refusal[2], refusal[2]


@pytest.mark.parametrize("overrides,message", [
    (["model.quantize=nf4"], "lora.rank=0; set lora.rank > 0"),
    (["model.quantize=fp4", "lora.rank=4", "backend=megatron"], "needs backend=deepspeed"),
    (["model.quantize=fp4", "lora.rank=4", "model.dtype=fp16"], "model.dtype=fp16 does not run on cpu"),
], ids=["no-lora", "megatron", "fp4-fp16-cpu"])
def test_bad_input_exits_2_before_anything_starts(overrides, message, tmp_path):
    code, _, err = refused(["train", "--run-dir", str(tmp_path / "run"), *[a for s in overrides for a in ("--set", s)]])
    assert code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "run" / "checkpoints").exists()

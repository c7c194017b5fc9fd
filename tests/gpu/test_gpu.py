"""The GPU layer: ``pytest -m gpu`` on a machine with one NVIDIA GPU (``benchmarks/gpu_check.py``
runs it first). Deselected unless ``-m gpu`` is given; never part of CI.

What only a GPU can show: both backends on NCCL with every tensor on the device, megatron vs HF
parity with GPU kernels in fp32 (TF32 off) and bf16, fp16 dynamic loss scaling on DeepSpeed (its CPU
accelerator has no fp16), a train + kill + resume + export cycle per backend, the converter on
GPU-written checkpoints, and megatron's MoE router without Transformer Engine.

``TOOLKIT_GPU_TESTS_ON_CPU=1`` runs the same tests on the CPU (gloo, fp32 and bf16 only) to
rehearse them before the short time on a GPU machine. Every test prints what it measured.
"""
from __future__ import annotations

import importlib.util
import json
import math
import os
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.gpu import (
    GPU_ONLY,
    REHEARSAL,
    check_router_stats,
    check_scales,
    deepspeed_scales,
    megatron_scales,
    records,
    resume_events,
    toolkit_train,
)
from tests.helpers.measure import measure
from tests.helpers.runs import run_cli
from toolkit.parallel import free_port

pytestmark = GPU_ONLY
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="fp16 on DeepSpeed needs a GPU")

FAMILIES = ["llama", "qwen2", "gpt2", "qwen3", "gemma", "gemma2", "phi3"]
MIXTRAL = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64,
           "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 2048, "max_position_embeddings": 256, "num_local_experts": 4, "num_experts_per_tok": 2,
           "tie_word_embeddings": False, "pad_token_id": 0}




# --- megatron vs HF on the device --------------------------------------------------------------------

def _spawned(rank, fn, args, out, port):
    """One rank in a fresh process (CUDA is never forked): process group, then ``fn``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from toolkit import device
    from toolkit.parallel import init_process_group
    init_process_group()
    if device.strict_requested():
        device.enable_strict()
    torch.save(fn(*args), out)


def in_fresh_process(fn, *args, tmp_path: Path):
    out = tmp_path / "result.pt"
    torch.multiprocessing.start_processes(_spawned, args=(fn, args, str(out), free_port()), nprocs=1,
                                          start_method="spawn")
    return torch.load(out, weights_only=False)


def _parity(family: str, dtype: str) -> dict:
    """Max relative errors of megatron's and HF's logits and gradients against HF in fp32 (IEEE, no
    TF32), for one batch; in ``dtype`` for the two under test."""
    from tests.helpers.ranks import megatron_engine
    from toolkit import device
    from toolkit.config import validate
    from toolkit.families.tiny import tiny_model
    from toolkit.loss import IGNORE_INDEX, token_loss_sum
    torch.set_float32_matmul_precision("highest")
    dev, dt = device.rank_device(), {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    g = torch.Generator().manual_seed(3)
    vocab = tiny_model(family).config.vocab_size
    micro = [{"input_ids": torch.randint(0, vocab, (2, 32), generator=g),
              "labels": torch.randint(0, vocab, (2, 32), generator=g)} for _ in range(2)]
    for mb in micro:
        mb["labels"][:, :3] = IGNORE_INDEX
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)

    def hf_run(model):
        model.zero_grad()
        logits = []
        for mb in micro:
            out = model(input_ids=mb["input_ids"].to(dev)).logits
            (token_loss_sum(out, mb["labels"].to(dev))[0] / tokens).backward()
            logits.append(out.detach().float().cpu())
        return logits, {n: p.grad.float().cpu() for n, p in model.named_parameters()}

    ref_logits, ref_grads = hf_run(tiny_model(family).to(dev))
    hf_logits, hf_grads = hf_run(tiny_model(family).to(dev, dt))
    cfg = validate({"backend": "megatron", "model": {"dtype": dtype, "tf32": False},
                    "train": {"global_batch_size": 4, "micro_batch_size": 2}})
    model = tiny_model(family)
    engine = megatron_engine(cfg, model)
    mg_logits = [x.float().cpu() for x in engine.logits(micro)]
    engine.forward_backward(micro, tokens, complete_grads=True)
    mg_grads = engine.hf_state(attr="main_grad")
    from toolkit import device
    on_host = [n for c in engine.model for n, p in c.named_parameters() if p.device != device.rank_device()]

    def rel(a, b):
        return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()
    return {"on_host": on_host, "hf_logits": max(rel(a, b) for a, b in zip(hf_logits, ref_logits)),
            "mg_logits": max(rel(a, b) for a, b in zip(mg_logits, ref_logits)),
            "hf_grads": {n: rel(hf_grads[n], g) for n, g in ref_grads.items()},
            "mg_grads": {n: rel(mg_grads[n], g) for n, g in ref_grads.items()}}


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_logits_and_grads_match_hf_fp32(family, tmp_path):
    r = in_fresh_process(_parity, family, "fp32", tmp_path=tmp_path)
    assert r["on_host"] == []  # torch norms are made on the default device: the build moves them
    worst = max(r["mg_grads"].values())
    measure("megatron logits rel", r["mg_logits"], 1e-5)  # IEEE fp32 on both sides: reduction order only
    measure("worst per-parameter grad rel", worst, 1e-4)
    assert r["mg_logits"] < 1e-5
    assert worst < 1e-4, {n: v for n, v in r["mg_grads"].items() if v >= 1e-4}


@pytest.mark.parametrize("family", FAMILIES)
def test_megatron_bf16_is_as_close_to_fp32_as_hf_bf16(family, tmp_path):
    """bf16 has no exact answer; megatron's bf16 must be about as far from the fp32 result as HF's own
    bf16 is (both keep fp32 master weights' values; megatron reduces grads in fp32)."""
    r = in_fresh_process(_parity, family, "bf16", tmp_path=tmp_path)
    print(f"\n{family} bf16 vs fp32: logits rel megatron {r['mg_logits']:.2e} HF {r['hf_logits']:.2e}; "
          f"median grad rel megatron {sorted(r['mg_grads'].values())[len(r['mg_grads']) // 2]:.2e} "
          f"HF {sorted(r['hf_grads'].values())[len(r['hf_grads']) // 2]:.2e}")
    measure("megatron bf16 logits rel", r["mg_logits"], 3 * r["hf_logits"] + 1e-3)
    ratio = max(err / (3 * r["hf_grads"][name] + 2e-2) for name, err in r["mg_grads"].items())
    measure("worst grad rel / its bound (3 x HF bf16's + 2e-2)", ratio, 1.0)
    assert r["mg_logits"] < 3 * r["hf_logits"] + 1e-3
    for name, err in r["mg_grads"].items():
        assert err < 3 * r["hf_grads"][name] + 2e-2, name


# --- train, kill, resume, export -------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["deepspeed", "megatron"])
def test_train_kill_resume_export(backend, tmp_path):
    dtype = "bf16"
    common = (f"backend={backend}", f"model.dtype={dtype}", "train.steps=8", "checkpoint.every=4")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    toolkit_train(whole, *common)
    toolkit_train(killed, *common, "restart.max_restarts=1", env={"TOOLKIT_FAULT": "kill:step=6"})
    assert [(e["checkpoint"], e["loaded"]) for e in resume_events(killed)] == [("step_00000004", "as saved")]
    a, b = records(whole), records(killed)
    print(f"\n{backend} {dtype} losses uninterrupted {[round(a[s]['loss'], 4) for s in a]}")
    print(f"{backend} {dtype} losses killed+resumed {[round(b[s]['loss'], 4) for s in b]}")
    assert all(math.isfinite(r["loss"]) for r in (*a.values(), *b.values()))
    assert a[8]["loss"] < a[1]["loss"]
    measure("resumed vs uninterrupted loss, max rel", max(abs(b[s]["loss"] - a[s]["loss"]) / a[s]["loss"] for s in a), 2e-2)
    for s in a:  # GPU kernels (flash attention's backward) are not bit-deterministic
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=2e-2), s
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(str(killed / "hf_final"))
    assert model.dtype == torch.float32 and all(torch.isfinite(p).all() for p in model.parameters())
    ref = AutoModelForCausalLM.from_pretrained(str(whole / "hf_final"))
    measure("exported weights, max |resumed - uninterrupted|",
            max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())), "5e-2 rel + 1e-3")
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.allclose(p, q, rtol=5e-2, atol=1e-3), n


def test_megatron_lora_trains_resumes_and_exports(tmp_path):
    """bf16 LoRA on megatron (the adapters on the device beside the frozen base, TP 1 on one GPU):
    the loss falls, kill + resume follows the uninterrupted run, ``adapter/`` holds every adapter
    in HF shapes with finite values and ``hf_final/`` is the merged fp32 model."""
    from safetensors.torch import load_file
    common = ("backend=megatron", "model.dtype=bf16", "train.steps=8", "checkpoint.every=4", "lora.rank=8",
              "train.lr=1e-2")
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    toolkit_train(whole, *common)
    toolkit_train(killed, *common, "restart.max_restarts=1", env={"TOOLKIT_FAULT": "kill:step=6"})
    assert [(e["checkpoint"], e["loaded"]) for e in resume_events(killed)] == [("step_00000004", "as saved")]
    a, b = records(whole), records(killed)
    print(f"\nmegatron LoRA bf16 losses {[round(a[s]['loss'], 4) for s in a]}; "
          f"resumed {[round(b[s]['loss'], 4) for s in b]}")
    assert all(math.isfinite(r["loss"]) for r in (*a.values(), *b.values()))
    assert a[8]["loss"] < a[1]["loss"]
    measure("resumed vs uninterrupted loss, max rel", max(abs(b[s]["loss"] - a[s]["loss"]) / a[s]["loss"] for s in a), 2e-2)
    for s in a:
        assert b[s]["loss"] == pytest.approx(a[s]["loss"], rel=2e-2), s
    adapter = load_file(str(killed / "adapter" / "adapter_model.safetensors"))
    plan = json.loads((killed / "plan.json").read_text())["lora"]
    assert sum(t.numel() for t in adapter.values()) == plan["trainable"]
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in adapter.values())
    assert (killed / "hf_final" / "config.json").is_file()


@needs_cuda
def test_deepspeed_fp16_skips_a_forced_overflow_and_trains_on(tmp_path):
    run = tmp_path / "fp16"  # two overflows in a row: hysteresis 2 halves the scale at the second
    toolkit_train(run, "model.dtype=fp16", "train.steps=10", env={"TOOLKIT_FAULT": "overflow:step=5;overflow:step=6"})
    r = records(run)
    print(f"\nDeepSpeed fp16 loss scales {[r[s]['loss_scale'] for s in r]}, skipped {[s for s in r if r[s]['skipped']]}")
    assert r[1]["loss_scale"] == 2.0**16  # ds_configs: initial_scale_power 16
    assert r[5]["skipped"] and r[6]["skipped"] and r[5]["grad_norm"] is None
    check_scales(r, deepspeed_scales)
    assert r[6]["loss_scale"] == r[4]["loss_scale"] / 2
    assert not r[7]["skipped"] and r[7]["grad_norm"] > 0  # the inf gradients did not outlive the step
    assert all(math.isfinite(r[s]["loss"]) for s in r)
    assert r[10]["loss"] < r[1]["loss"] and r[10]["skipped_steps"] == sum(r[s]["skipped"] for s in r)


def test_megatron_fp16_skips_and_trains_on(tmp_path):
    run = tmp_path / "fp16"
    toolkit_train(run, "backend=megatron", "model.dtype=fp16", "train.steps=30",
                  env={"TOOLKIT_FAULT": "overflow:step=26;overflow:step=27"})
    r = records(run)
    print(f"\nmegatron fp16 loss scales {[r[s]['loss_scale'] for s in r]}")
    # megatron.initial_loss_scale (toolkit/config.py: 2^16, where DeepSpeed starts; megatron-core's own 2^32
    # skipped ~13 steps): hysteresis 2 keeps it through step 1 even if step 1 overflows
    measure("initial loss scale", r[1]["loss_scale"], 2.0**16)
    assert r[1]["loss_scale"] == 2.0**16
    assert r[26]["skipped"] and r[27]["skipped"]
    check_scales(r, megatron_scales)
    assert all(math.isfinite(r[s]["loss"]) for s in r) and r[30]["loss"] < r[1]["loss"]


# --- packed documents end to end (compiled flex on the device) -------------------------------------

PACKED = ("data.seq_len=128", "train.steps=2", "train.global_batch_size=8", "train.micro_batch_size=2", "train.lr=0",
          "train.min_lr=0", "train.warmup_steps=0", "train.eval_every=0", "train.log_every=1", "checkpoint.every=100",
          "train.export_hf=false", "data.eval_fraction=0", "data.format=json", "data.template=instruction",
          "model.tf32=false")


@pytest.mark.parametrize("backend", ["deepspeed", "megatron"])
def test_packed_documents_give_the_losses_of_pad_end_to_end(backend, tmp_path):
    """tests/e2e/test_packing_train.py on the device: weights fixed (lr=0), one instruction repeated, so
    every document's loss is the same whatever shares its row: ``documents`` (flex_attention with a
    block mask, compiled, on CUDA) must give the losses of ``pad`` (one document per row, no mask);
    ``concat`` (documents see their predecessors) must differ."""
    data = tmp_path / "same.jsonl"
    row = {"prompt": "Reverse the words: one two three four", "response": "four three two one"}
    data.write_text((json.dumps(row) + "\n") * 64)
    loss = {}
    for mode in ("documents", "pad", "concat"):
        run_dir = tmp_path / mode
        args = ["train", "--run-dir", str(run_dir), "--nproc", "1"]
        for s in (*PACKED, f"backend={backend}", f"data.path={data}", f"data.packing={mode}"):
            args += ["--set", s]
        run_cli(args, timeout=900)
        loss[mode] = [records(run_dir)[s]["loss"] for s in (1, 2)]
    assert all(math.isfinite(x) for xs in loss.values() for x in xs), loss
    gap = measure("documents vs pad, max rel", max(abs(a - b) / b for a, b in zip(loss["documents"], loss["pad"])), 1e-5)
    concat = measure("concat vs pad, min rel", min(abs(a - b) / b for a, b in zip(loss["concat"], loss["pad"])), 1e-3)
    assert gap < 1e-5 and concat > 1e-3, loss  # CPU: 4.7e-8 (DeepSpeed), 1.2e-7 (megatron); concat 5.3e-3


# --- the converter on GPU-written checkpoints, MoE without Transformer Engine --------------------------

def test_converter_reads_gpu_checkpoints_exactly(tmp_path):
    zero, meg = tmp_path / "zero3", tmp_path / "meg"
    toolkit_train(zero, "zero.stage=3", "model.dtype=bf16", "train.steps=2", "checkpoint.every=2")
    toolkit_train(meg, "backend=megatron", "model.dtype=bf16", "train.steps=2", "checkpoint.every=2")
    for src, to in ((zero, "megatron"), (zero, "hf"), (meg, "zero"), (meg, "hf")):
        out = tmp_path / f"{src.name}_to_{to}"
        extra = ["--tp", "1"] if to == "megatron" else []
        proc = run_cli(["convert", str(src / "checkpoints" / "step_00000002"), str(out), "--to", to, "--verify", *extra])
        print(f"\n{src.name} -> {to}: {proc.stdout.strip().splitlines()[-1]}")


def test_megatron_moe_without_transformer_engine(tmp_path):
    model = tmp_path / "mixtral"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(MIXTRAL))
    run = tmp_path / "moe"
    toolkit_train(run, "backend=megatron", f"model.name_or_path={model}", "model.dtype=bf16", "train.steps=4")
    r = records(run)
    check_router_stats(r, tokens=8 * 128, top_k=MIXTRAL["num_experts_per_tok"], layers=MIXTRAL["num_hidden_layers"])
    assert all(math.isfinite(r[s]["loss"]) for s in r) and r[4]["loss"] < r[1]["loss"]
    te = importlib.util.find_spec("transformer_engine") is not None
    print(f"\nMoE on megatron, Transformer Engine {'present' if te else 'absent'}: losses "
          f"{[round(r[s]['loss'], 4) for s in r]}")


def test_doctor_sees_the_gpu():
    proc = run_cli(["doctor"], check=False)
    print("\n" + proc.stdout)
    assert proc.returncode == 0 and ("gpu 0" in proc.stdout or REHEARSAL), proc.stdout


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-m", "gpu", "-v", "-s"]))

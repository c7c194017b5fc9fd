"""The features of the latest releases on the device (``pytest -m gpu``; ``benchmarks/gpu_check.py`` runs
them in its ``tests_features`` phase with test_offload_activations_gpu.py and test_packing_gpu.py):
DPO through ``toolkit train`` (bf16: the first step's loss is ln 2, the policy being its own
reference), the sequence tiles' gradients in bf16 against fp32, and LoRA through ``toolkit train``
(bf16 adapters on a frozen base). Each records what it measured beside its bound
(``tests/helpers/measure.py``); ``TOOLKIT_GPU_TESTS_ON_CPU=1`` rehearses them on the CPU (fp32)."""
from __future__ import annotations

import json
import math

import torch

from tests.helpers.dpo import write_preference_data
from tests.helpers.gpu import DEVICE, DTYPE, GPU_ONLY, records, toolkit_train
from tests.helpers.measure import measure
from tests.helpers.tiles import BF16_BOUND, TILES, lm_head_errors, mlp_errors

pytestmark = GPU_ONLY

DPO_LN2_ATOL = 1e-2
"""|first DPO loss - ln 2|: the reference scores and the first step's forward are the same bf16 model
through different kernels (no grad, then grad): their log-probability sums of an answer differ by
bf16 rounding, a few 1e-2 over ~20 tokens, x beta (0.1) / 4 in the loss. Exactly ln 2 in fp32."""


def _base(path):
    """The demo's tiny Llama (seed 0) saved as the pretrained base DPO and LoRA start from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from toolkit.config import DEMO_DIR
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEMO_DIR / "tiny-llama")).save_pretrained(path)
    return path


def test_dpo_starts_at_ln2_and_learns(tmp_path):
    """DPO on DeepSpeed ZeRO-1 in bf16: the reference scored on the device before any step, step 1's
    loss ln 2 (policy = reference), every loss and reward finite, the loss falling over 3 steps."""
    data = write_preference_data(tmp_path / "pairs.jsonl", n=48)
    run = tmp_path / "dpo"
    toolkit_train(run, f"model.name_or_path={_base(tmp_path / 'base')}", "model.init=pretrained",
                  f"model.dtype={DTYPE}", "zero.stage=1", "data.format=json", "data.template=preference",
                  f"data.path={data}", "train.objective=dpo", "train.steps=3", "train.eval_every=0",
                  "train.lr=1e-3", "train.warmup_steps=0", "checkpoint.every=100", "train.export_hf=false")
    r = records(run)
    gap = measure("|step-1 loss - ln 2|", abs(r[1]["loss"] - math.log(2)), DPO_LN2_ATOL)
    measure("losses", [round(r[s]["loss"], 5) for s in sorted(r)])
    assert all(math.isfinite(v) for s in r for k, v in r[s].items() if k.startswith(("loss", "rewards")))
    assert gap < DPO_LN2_ATOL
    assert r[3]["loss"] < r[1]["loss"]


def test_bf16_tiled_loss_gradient_as_close_to_fp32_as_untiled(strict_fp32):
    """``zero.tiled_loss``'s lm_head gradient over 64 tiles in bf16 on the device (``loss.TileGrads``
    sums it in fp32): within 1.5x the untiled bf16 gradient's error against fp32."""
    errors = lm_head_errors(DEVICE)
    ratio = measure(f"lm_head grad error, {TILES} tiles / untiled (bf16 vs fp32)", errors["tiled"] / errors["untiled"],
                    BF16_BOUND)
    measure("lm_head grad error, tiled and untiled", [errors["tiled"], errors["untiled"]])
    assert ratio < BF16_BOUND


def test_bf16_tiled_mlp_gradients_as_close_to_fp32_as_untiled(strict_fp32):
    """``zero.tiled_mlp``'s weight gradients over 64 tiles in bf16 on the device: within 1.5x the
    untiled bf16 gradients' errors against fp32, the tiles run (forward and recompute)."""
    errors = mlp_errors(DEVICE)
    worst = max(errors["tiled"][n] / errors["untiled"][n] for n in errors["tiled"])
    measure(f"worst MLP grad error, {TILES} tiles / untiled (bf16 vs fp32)", worst, BF16_BOUND)
    assert errors["tile_calls"] == 2 * TILES
    assert worst < BF16_BOUND


def test_lora_trains_only_its_adapters(tmp_path):
    """LoRA (rank 8) on DeepSpeed ZeRO-1 in bf16: the loss falls, ``adapter/`` holds exactly the
    plan's trainable parameters, finite, the frozen base not among them, and every B (peft starts it
    at zero) moved: the adapters trained."""
    from safetensors.torch import load_file
    run = tmp_path / "lora"
    toolkit_train(run, f"model.name_or_path={_base(tmp_path / 'base')}", "model.init=pretrained",
                  f"model.dtype={DTYPE}", "zero.stage=1", "lora.rank=8", "train.lr=1e-2", "train.steps=4",
                  "train.eval_every=0", "checkpoint.every=100")
    r = records(run)
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    trainable = json.loads((run / "plan.json").read_text())["lora"]["trainable"]
    measure("losses", [round(r[s]["loss"], 5) for s in sorted(r)])
    measure("adapter parameters / plan's trainable", [sum(t.numel() for t in adapter.values()), trainable])
    smallest_b = min(t.abs().max().item() for k, t in adapter.items() if "lora_B" in k)
    measure("smallest max |lora_B| (0 at the start)", smallest_b, "> 0")
    assert sum(t.numel() for t in adapter.values()) == trainable
    assert smallest_b > 0
    assert all(torch.isfinite(t).all() for t in adapter.values()) and all("lora_" in k for k in adapter)
    assert all(math.isfinite(r[s]["loss"]) for s in r) and r[4]["loss"] < r[1]["loss"]

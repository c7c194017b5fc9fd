"""LoRA references the DeepSpeed, megatron and zoo LoRA tests share: seeded adapters, HF + peft's own
forward, gradients and AdamW loop, the run overrides, and their tolerances."""
from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F

from tests.helpers.parity import batches
from tests.helpers.runs import train
from toolkit.config import load_config, validate
from toolkit.families.tiny import tiny_model
from toolkit.loss import IGNORE_INDEX

RANK, ALPHA = 4, 8.0
LOGIT_TOL = 1e-6  # measured 0.0 (bit-identical logits) for all three families at ZeRO-2 and ZeRO-3
GRAD_RTOL = 1e-5  # per parameter, max |ours - peft| <= GRAD_RTOL x max |peft| of that gradient; measured
#                   worst 2.5e-6 (qwen2 ZeRO-3, q_proj.lora_A), 5.5e-7 llama ZeRO-3, <= 2.3e-7 at ZeRO-2
#                   (the DP reduction sums in another order)
EXPORT_LOGIT_TOL = 5e-6  # peft's unmerged forward vs the merged hf_final: measured 6.0e-7 (ZeRO-2), 7.2e-7 (ZeRO-3)
LOSS_RTOL = 1e-6  # measured 1.3e-7 ZeRO-2, 9.4e-8 ZeRO-3, 7.8e-8 ZeRO-0, 1.3e-7 ZeRO-3 offload (CPU Adam kernels
#                   vs torch's AdamW, DP sums)

MEGATRON_LOGIT_TOL = 2e-6  # as the full-model megatron parity (other matmul shapes, reduction orders); measured
#                            <= 2.8e-7
MEGATRON_GRAD_RTOL = 2e-5
"""Megatron LoRA, per adapter matrix: max |megatron - peft| <= MEGATRON_GRAD_RTOL x max |peft|; measured worst
3.8e-6 (qwen2 tp2, q_proj.lora_A), <= 2.5e-6 at tp2_sp, <= 2.2e-6 at pp2, ~1e-6 for qwen2_moe."""

def adapter_values(model) -> dict[str, torch.Tensor]:
    """Non-zero adapters (peft's init has B = 0, under which A gets no gradient), by name, alike on
    every rank and in the reference."""
    return {name: seeded_adapter(name, tuple(getattr(p, "ds_shape", p.shape)))
            for name, p in model.named_parameters() if p.requires_grad}


def seeded_adapter(name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """An adapter's test value, from its peft name alone."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(shape, generator=g) * 0.05


def reference(base_dir, micro_batches, modules_to_save=(), targets="all-linear", quantization_config=None):
    """HF + peft (peft's own all-linear by default), one process: logits per micro-batch and the
    gradients of sum(token losses) / valid tokens of the global batch. ``quantization_config``: a
    ``BitsAndBytesConfig``, the base quantized by transformers (QLoRA; ``hf_4bit``)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    base = hf_4bit(base_dir, quantization_config) if quantization_config else \
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, task_type="CAUSAL_LM",
                                            modules_to_save=list(modules_to_save) or None))
    with torch.no_grad():
        for name, value in adapter_values(model).items():
            model.get_parameter(name).copy_(value)
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro_batches)
    logits = []
    for mb in micro_batches:
        out = model(input_ids=mb["input_ids"]).logits
        F.cross_entropy(out.flatten(0, 1).float(), mb["labels"].flatten(), ignore_index=IGNORE_INDEX,
                        reduction="sum").div(tokens).backward()
        logits.append(out.detach())
    return logits, {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def hf_4bit(base_dir, quantization_config):
    """``base_dir`` quantized by transformers on the CPU (``BitsAndBytesConfig``), bitsandbytes' CPU
    AVX512-BF16 repack off (in eval under no_grad it rewrites weights in place: docs/lora.md)."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, quantization_config=quantization_config,
                                                 dtype=quantization_config.bnb_4bit_compute_dtype, device_map="cpu")
    for m in model.modules():
        if isinstance(m, bnb.nn.Linear4bit):
            m.support_avx512bf16_for_cpu = False
    return model


def seeded_lora_engine(world: int, base_dir, stage: int, modules_to_save=(), **model):
    """A ``DeepSpeedEngine`` of LoRA (``RANK``, ``ALPHA``) on ``base_dir`` at ZeRO ``stage``, its
    adapters set to ``adapter_values`` (the reference's draws); returns the plan and the engine.
    ``model``: more ``model.*`` settings (``quantize="nf4"``)."""
    from toolkit.adapters.deepspeed import DeepSpeedEngine, build_model
    from toolkit.plan import build_plan
    cfg = validate({"model": {"name_or_path": base_dir, "init": "pretrained", **model}, "zero": {"stage": stage},
                    "lora": {"rank": RANK, "alpha": ALPHA, "modules_to_save": list(modules_to_save)},
                    "train": {"global_batch_size": 4, "micro_batch_size": 1}})
    plan = build_plan(cfg, [world])
    model = build_model(plan, plan.ds_config(world))
    with torch.no_grad():  # adapters are whole on every rank until deepspeed.initialize
        for name, value in adapter_values(model).items():
            model.get_parameter(name).copy_(value)
    return plan, DeepSpeedEngine(plan, model)


def step_global_batch(engine, rank: int, world: int) -> tuple[list, dict]:
    """This rank's micro-batches of ``batches`` through the engine as ``train_step`` sends them, then
    one optimizer step: this rank's logits and every trained parameter's whole gradient, reduced over
    DP at the accumulation boundary (before the step)."""
    from deepspeed.utils import safe_get_full_grad
    micro = batches(engine.module.config.vocab_size)
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
    mine = micro[rank * 2:(rank + 1) * 2]
    logits, grads = [], {}
    for i, mb in enumerate(mine):
        out = engine.engine(input_ids=mb["input_ids"])
        loss = F.cross_entropy(out.logits.flatten(0, 1).float(), mb["labels"].flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
        engine.engine.backward(loss * world / tokens, scale_wrt_gas=False)
        logits.append(out.logits.detach().clone())
        if i == len(mine) - 1:
            grads = {n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters() if p.requires_grad}
        engine.engine.step()
    return logits, grads


def assert_adapters_match_peft(label: str, logit_gap: float, grads: dict, ref_grads: dict,
                               logit_tol: float = LOGIT_TOL, grad_rtol: float = GRAD_RTOL) -> None:
    """The engine's logits within ``logit_tol`` of peft's, and every adapter's whole gradient within
    ``grad_rtol`` of peft's, relative to that gradient's max (one adapter per HF projection, peft's
    names; B != 0 in the seeded adapters, so every one gets a gradient)."""
    assert sorted(grads) == sorted(ref_grads)
    ratios = {n: (grads[n] - g).abs().max().item() / g.abs().max().item() for n, g in ref_grads.items()}
    worst = max(ratios, key=ratios.get)
    print(f"\n{label}: max logit gap {logit_gap:.2e}; worst adapter grad gap {ratios[worst]:.2e} of its max ({worst})")
    assert logit_gap <= logit_tol
    assert ratios[worst] <= grad_rtol, worst
    assert all(g.abs().max() > 0 for g in ref_grads.values())


LORA_RUN = ["lora.rank=4", f"lora.alpha={ALPHA}", "model.init=pretrained", "checkpoint.every=3"]
DECAY_CLIP = ["train.weight_decay=1.0", "train.grad_clip=0.05"]
"""Weight decay 100x the default (the adapters shrink by ~1% over 6 steps: at 0.01 decay moves them
by 1e-4, inside the comparison's tolerance) and a clip under every step's grad norm (0.33-0.38 here,
so the default 1.0 never engages)."""


def trained_once(root, data_cache, demo_base, runs: dict, *overrides: str):
    """``get(name)``: the run dir of LoRA run ``name`` of the demo base (``runs[name]``: its
    overrides), trained on first use."""
    cache = {}

    def get(name: str):
        if name not in cache:
            train(root / name, data_cache, *LORA_RUN, f"model.name_or_path={demo_base}", *overrides, *runs[name])
            cache[name] = root / name
        return cache[name]
    return get


def lr_at(step: int, steps=6, warmup=2, peak=3e-3, floor=3e-4) -> float:
    """TINY's schedule as the README states it: linear warmup, then cosine decay to min_lr."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return floor + 0.5 * (peak - floor) * (1 + math.cos(math.pi * progress))


def reference_losses(demo_base, data_cache, modules_to_save=(), steps: int = 6, lr_scale: float = 1.0) -> list[float]:
    """The single-process peft loop's losses (``reference_run``)."""
    return reference_run(demo_base, data_cache, modules_to_save, steps, lr_scale)["losses"]


def reference_run(demo_base, data_cache, modules_to_save=(), steps: int = 6, lr_scale: float = 1.0,
                  weight_decay: float = 0.01, clip: float = 1.0) -> dict:
    """One process: HF + peft with the adapter init the toolkit documents (peft's own init, drawn from
    a CPU generator seeded with (train.seed, "lora")), torch AdamW (matrices decayed), the global
    batch of 8 in one forward, loss = sum of token losses / valid tokens, grad clip ``clip``. Its
    losses, its grad norms before clipping, and the trained adapter as peft saves it."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from toolkit.data import global_batch_indices, load_tokenizer, prepare_data
    from toolkit.parallel import unit_seed
    cfg = load_config(None, [f"model.name_or_path={demo_base}", "data.seq_len=32", f"data.cache_dir={data_cache}"])
    ds = prepare_data(cfg, load_tokenizer(cfg)).train.with_format("torch", columns=["input_ids", "labels"])
    base = AutoModelForCausalLM.from_pretrained(demo_base, dtype=torch.float32)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(unit_seed(cfg.train.seed, "lora"))
        model = get_peft_model(base, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear",
                                                task_type="CAUSAL_LM", modules_to_save=list(modules_to_save) or None))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.95), eps=1e-8, weight_decay=weight_decay)
    out = {"losses": [], "grad_norms": []}
    for step in range(steps):
        batch = ds[global_batch_indices(len(ds), 8, cfg.train.seed, step)]
        labels = batch["labels"]
        logits = model(input_ids=batch["input_ids"]).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX,
                               reduction="sum") / (labels != IGNORE_INDEX).sum()
        loss.backward()
        out["grad_norms"].append(torch.nn.utils.clip_grad_norm_(params, clip).item())
        for group in opt.param_groups:
            group["lr"] = lr_at(step) * lr_scale
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
    out["adapter"] = {n: t.detach().clone() for n, t in get_peft_model_state_dict(model).items()}
    return out


ADAPTER_RTOL = 2e-4
"""Trained adapters vs the peft loop's, per tensor, max |gap| / max |peft|, after 6 Adam steps
(Adam divides by sqrt(v): entries whose gradient is near eps carry the fp32 rounding of another
reduction order into the update)."""
GRAD_NORM_RTOL = 1e-5


def check_decay_and_clip_against_peft(run_dir, demo_base, data_cache, label: str) -> None:
    """A run with ``DECAY_CLIP``: losses, pre-clip grad norms (metrics.jsonl) and the exported adapter
    equal the peft loop's with the same decay and clip; the check can tell a missing decay (the
    adapters) and a missing clip (the losses) apart from a pass."""
    from safetensors.torch import load_file

    from toolkit.observe.metrics import read_metrics
    want = reference_run(demo_base, data_cache, weight_decay=1.0, clip=0.05)
    no_decay = reference_run(demo_base, data_cache, weight_decay=0.0, clip=0.05)["adapter"]
    no_clip = reference_run(demo_base, data_cache, weight_decay=1.0, clip=1e9)["losses"]
    rows = [r for _, r in sorted(read_metrics(run_dir).items())]
    got_losses, got_norms = [r["loss"] for r in rows], [r["grad_norm"] for r in rows]
    adapter = load_file(run_dir / "adapter" / "adapter_model.safetensors")
    assert sorted(adapter) == sorted(want["adapter"])

    def worst(a: dict, b: dict) -> float:
        return max(((a[n] - t).abs().max() / t.abs().max()).item() for n, t in b.items())
    loss_gap = max(abs(a - b) / b for a, b in zip(got_losses, want["losses"]))
    norm_gap = max(abs(a - b) / b for a, b in zip(got_norms, want["grad_norms"]))
    decay_moved, clip_moved = worst(no_decay, want["adapter"]), max(
        abs(a - b) / b for a, b in zip(no_clip, want["losses"]))
    norms, adapter_gap = want["grad_norms"], worst(adapter, want["adapter"])
    print(f"\n{label} decay 1.0, clip 0.05 vs the peft loop: losses {loss_gap:.2e}, grad norms {norm_gap:.2e} "
          f"(peft's {min(norms):.3f}-{max(norms):.3f}), adapters {adapter_gap:.2e}; "
          f"without decay the adapters move {decay_moved:.2e}, without clip the losses {clip_moved:.2e}")
    assert min(want["grad_norms"]) > 0.05  # the clip engages at every step
    assert decay_moved > 10 * ADAPTER_RTOL and clip_moved > 10 * LOSS_RTOL
    assert len(got_losses) == 6 and loss_gap <= LOSS_RTOL
    assert norm_gap <= GRAD_NORM_RTOL
    assert adapter_gap <= ADAPTER_RTOL


def peft_merge_gaps(run_dir, base_dir) -> list[str]:
    """Names of hf_final/'s tensors that differ from peft's ``merge_and_unload()`` of the run's
    ``adapter/`` onto the base as its files store it (fp32), bit for bit; the keys must be the same."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, run_dir / "adapter").merge_and_unload().state_dict()
    final = load_file(run_dir / "hf_final" / "model.safetensors")
    assert sorted(final) == sorted(merged)
    return [n for n, t in final.items() if not torch.equal(t, merged[n])]


def check_random_init_export(run_dir) -> None:
    """``hf_final/`` of a LoRA run on a random-init base is peft's ``merge_and_unload()`` of the run's
    ``adapter/`` onto that base, tensor for tensor. The base is the toolkit's seeded init (the same
    on both backends), rebuilt here in one process from the run's plan.json. Without the merge
    hf_final/ held the bare base and passed every other test (mutated once)."""
    from peft import PeftModel
    from safetensors.torch import load_file

    from toolkit.adapters.hf import build_model
    from toolkit.plan import read_plan
    base = build_model(read_plan(run_dir / "plan.json")).eval()
    unmerged = {n: t.clone() for n, t in base.state_dict().items()}
    merged = PeftModel.from_pretrained(base, run_dir / "adapter").merge_and_unload().state_dict()
    final = load_file(run_dir / "hf_final" / "model.safetensors")
    assert sorted(final) == sorted(merged)
    differs = [n for n, t in final.items() if not torch.equal(t, merged[n])]
    adapted = [n for n in merged if not torch.equal(merged[n], unmerged[n])]
    print(f"\n{run_dir.name}: hf_final vs peft's merge onto the seeded base: {len(differs)} tensors differ; "
          f"the merge changed {len(adapted)} of {len(merged)}")
    assert not differs, differs[:5]
    assert adapted and all("proj" in n for n in adapted)  # all-linear adapts every *_proj, nothing else


def tiny_bases(root, families) -> dict[str, str]:
    """Each family's ``tiny_model`` saved under ``root/family`` as an HF base: {family: its path}."""
    for family in families:
        tiny_model(family).save_pretrained(root / family)
    return {f: str(root / f) for f in families}

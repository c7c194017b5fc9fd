"""Peak resident memory per rank of QLoRA (``model.quantize=nf4``) against LoRA and full fine-tuning of the
same ~375M-parameter Llama, DeepSpeed ZeRO-2 on 2 gloo ranks, at load and at the first step.

    python benchmarks/qlora_memory.py                 # fp32, seq 256, micro-batch 1 (~10 min on 2 shared cores)
    python benchmarks/qlora_memory.py --dtype bf16 --modes qlora,lora

The model (hidden 1024, 24 layers, MLP 2816, vocabulary 32000 untied: 374M parameters, 308M of them in the
linear layers a 4-bit base quantizes) is drawn by the toolkit's seeded init piece by piece
(``model.init=random``: no checkpoint on disk). LoRA rank 16 on all linear layers. Per rank (the table shows
the fullest): ``imports_mib``, resident memory before the model is built (torch, DeepSpeed, transformers);
``load_mib``, the high-water mark (VmHWM) from the process start to the built engine (model, adapters,
``deepspeed.initialize``); ``step_mib``, the high-water mark during the first training step (VmHWM reset
through /proc/self/clear_refs after glibc's malloc_trim); ``load_s``, the build time. Each rank fixes
glibc's mmap threshold first, as every toolkit rank does (``toolkit/heap.py``). Results:
benchmarks/results/qlora_memory.json (by dtype; ``fp32_before_heap_fixes``: the first run, before the
loader returned each piece's freed pages: QLoRA's load peak was 0.68x LoRA's).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 1024, "num_hidden_layers": 24,
         "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 2816, "vocab_size": 32000,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
MODES = {"qlora": {"model": {"quantize": "nf4"}, "lora": {"rank": 16}},
         "lora": {"lora": {"rank": 16}},
         "full": {}}


def _memory_mib() -> dict:
    status = Path("/proc/self/status").read_text().splitlines()
    kb = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss": kb["VmRSS"] / 1024, "hwm": kb["VmHWM"] / 1024}


def _rank(rank, world, model_dir, mode, dtype, seq, micro):
    import ctypes

    import torch
    import torch.distributed as dist

    from toolkit import heap
    from toolkit.adapters.deepspeed import DeepSpeedEngine, build_model
    from toolkit.config import validate
    from toolkit.plan import build_plan
    heap.return_large_frees()  # as every toolkit rank does first (train/worker.py)
    imports = _memory_mib()["rss"]
    raw = {"model": {"name_or_path": model_dir, "dtype": dtype, **MODES[mode].get("model", {})},
           "zero": {"stage": 2}, "lora": MODES[mode].get("lora", {}),
           "train": {"global_batch_size": world * micro, "micro_batch_size": micro, "lr": 1e-4, "min_lr": 1e-5}}
    plan = build_plan(validate(raw), [world])
    tic = time.perf_counter()
    engine = DeepSpeedEngine(plan, build_model(plan, plan.ds_config(world)))
    dist.barrier()
    load_s, load = time.perf_counter() - tic, _memory_mib()
    g = torch.Generator().manual_seed(rank)
    mbs = [{"input_ids": torch.randint(1, MODEL["vocab_size"], (micro, seq), generator=g),
            "labels": torch.randint(1, MODEL["vocab_size"], (micro, seq), generator=g)}]
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    tic = time.perf_counter()
    stats = engine.train_step(mbs, world * micro * seq, 1e-4)
    step_s, step = time.perf_counter() - tic, _memory_mib()
    trained = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return {"imports_mib": imports, "load_mib": load["hwm"], "held_after_load_mib": load["rss"],
            "step_mib": step["hwm"], "load_s": load_s, "step_s": step_s, "loss": stats.loss, "trained": trained}


def run(modes: list[str], dtype: str, seq: int, micro: int, world: int = 2) -> list[dict]:
    from tests.helpers.ranks import run_ranks
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(MODEL))
        for mode in modes:
            out = Path(tmp) / mode
            out.mkdir()
            ranks = run_ranks(_rank, world, out, str(model_dir), mode, dtype, seq, micro, timeout=3600)
            top = {k: max(r[k] for r in ranks) for k in ("imports_mib", "load_mib", "step_mib", "load_s", "step_s")}
            rows.append({"mode": mode, "ranks": ranks, **top, "trained": ranks[0]["trained"], "loss": ranks[0]["loss"]})
            print(f"{mode}: load peak {top['load_mib']:.0f} MiB per rank (imports {top['imports_mib']:.0f}), first step "
                  f"peak {top['step_mib']:.0f} MiB, load {top['load_s']:.0f} s, step {top['step_s']:.1f} s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    lora = next((r for r in rows if r["mode"] == "lora"), None)
    lines = ["| mode | trained | imports MiB | load peak MiB | vs LoRA | above imports vs LoRA | first-step peak MiB | "
             "load s | step s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['load_mib'] / lora['load_mib']:.2f}" if lora else "-"
        net = f"{(r['load_mib'] - r['imports_mib']) / (lora['load_mib'] - lora['imports_mib']):.2f}" if lora else "-"
        lines.append(f"| {r['mode']} | {r['trained']:,} | {r['imports_mib']:.0f} | {r['load_mib']:.0f} | {ratio} | {net} | "
                     f"{r['step_mib']:.0f} | {r['load_s']:.0f} | {r['step_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", default="qlora,lora,full")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--micro", type=int, default=1)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "qlora_memory.json"))
    args = parser.parse_args()
    rows = run(args.modes.split(","), args.dtype, args.seq, args.micro)
    out = Path(args.out)
    results = json.loads(out.read_text()) if out.is_file() else {}
    results[args.dtype] = {"model": MODEL, "args": vars(args), "rows": rows, "table": table(rows)}
    out.write_text(json.dumps(results, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()

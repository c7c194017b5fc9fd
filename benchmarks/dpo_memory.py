"""Peak resident memory per rank of DPO against supervised fine-tuning (SFT) on the same layout, model,
sequence length and batch, measured side by side in one run: DPO holds no second (reference) model.

    python benchmarks/dpo_memory.py          # ZeRO-1 on 2 ranks, seq 1024, micro-batch 2 x 2 (~6 min, 2 shared cores)
    python benchmarks/dpo_memory.py --stage 3 --seq 512

A Llama of 29M parameters (hidden 512, 4 layers, vocabulary 16384; 118 MB of fp32 weights: a
reference model held beside the policy would add that much), fp32, DeepSpeed ZeRO ``--stage`` on
``--world`` gloo ranks. Both objectives get the same micro-batches: rows of 4 documents (2 pairs), labels
on each document's second half. DPO first scores its reference with the engine itself
(``Engine.document_logps``, as ``toolkit/train/reference.py`` does before training) and feeds the scores
as ``ref_logps``. Per rank, after one warm-up step and glibc's malloc_trim: ``held_mib``, the resident
memory before the measured step (model, optimizer state, everything the run keeps); ``step_mib``, the
high-water mark during the step (VmHWM, reset through /proc/self/clear_refs) above it; ``peak_mib``
their sum; ``process_hwm_mib``, the high-water mark since the process started (loading and, for DPO,
the reference pass included). ``models``: live transformers models in the process (gc); ``param_mib``:
the engine's parameters. The table shows the fullest rank. Results: benchmarks/results/dpo_memory.json.
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

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 1376, "vocab_size": 16384,
         "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
DOCUMENTS = 4  # per row: 2 pairs


def _memory_mib() -> dict:
    status = Path("/proc/self/status").read_text().splitlines()
    kb = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss": kb["VmRSS"] / 1024, "hwm": kb["VmHWM"] / 1024}


def micro_batches(n: int, micro: int, seq: int, vocab: int, seed: int = 0) -> list[dict]:
    """``n`` micro-batches of ``micro`` rows of ``DOCUMENTS`` documents each, labels on each second half."""
    import torch

    from toolkit.loss import IGNORE_INDEX
    g = torch.Generator().manual_seed(seed)
    doc = seq // DOCUMENTS
    document_ids = torch.arange(1, DOCUMENTS + 1).repeat_interleave(doc).expand(micro, -1).contiguous()
    answer = (torch.arange(seq) % doc >= doc // 2).expand(micro, -1)
    out = []
    for _ in range(n):
        ids = torch.randint(1, vocab, (micro, seq), generator=g)
        labels = torch.randint(1, vocab, (micro, seq), generator=g).masked_fill(~answer, IGNORE_INDEX)
        out.append({"input_ids": ids, "labels": labels, "document_ids": document_ids.clone()})
    return out


def _rank(rank, world, model_dir, objective, stage, seq, micro, accumulation):
    import ctypes

    import torch.distributed as dist

    from tests.helpers.dpo import held_models
    from toolkit.adapters.deepspeed import DeepSpeedEngine, build_model
    from toolkit.config import validate
    from toolkit.objectives import REF_COLUMN
    from toolkit.plan import build_plan
    dpo = objective == "dpo"
    cfg = validate({"model": {"name_or_path": model_dir}, "zero": {"stage": stage},
                    "data": {"seq_len": seq, "packing": "documents", **({"template": "preference"} if dpo else {})},
                    "train": {"objective": objective, "global_batch_size": world * micro * accumulation,
                              "micro_batch_size": micro, "lr": 1e-4, "min_lr": 1e-5}})
    plan = build_plan(cfg, [world])
    engine = DeepSpeedEngine(plan, build_model(plan, plan.ds_config(world)))
    mbs = micro_batches(accumulation, micro, seq, MODEL["vocab_size"], seed=rank)
    if dpo:  # the reference pass, with the engine itself (toolkit/train/reference.py)
        for mb, ref in zip(mbs, engine.document_logps(mbs, DOCUMENTS)):
            mb[REF_COLUMN] = ref.cpu()
    # the global batch's pairs (DPO) or loss tokens (SFT): every rank's micro-batches have the same shape
    count = world * (micro * accumulation * DOCUMENTS // 2 if dpo else sum(int((mb["labels"] >= 0).sum()) for mb in mbs))
    engine.train_step(mbs, count, 1e-4)  # warm-up: optimizer state, one-time buffers
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the heap the warm-up freed goes back: the step's own peak is seen
    dist.barrier()
    before = _memory_mib()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    tic = time.perf_counter()
    stats = engine.train_step(mbs, count, 1e-4)
    seconds = time.perf_counter() - tic
    after = _memory_mib()
    return {"held_mib": before["rss"], "step_mib": after["hwm"] - before["rss"], "peak_mib": after["hwm"],
            "process_hwm_mib": before["hwm"], "step_s": seconds, "loss": stats.loss, **held_models(engine)}


def run(stage: int, world: int, seq: int, micro: int, accumulation: int) -> list[dict]:
    from tests.helpers.ranks import run_ranks
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(MODEL))
        for objective in ("sft", "dpo"):
            out = Path(tmp) / objective
            out.mkdir()
            ranks = run_ranks(_rank, world, out, str(model_dir), objective, stage, seq, micro, accumulation,
                              timeout=1800)
            top = max(ranks, key=lambda r: r["peak_mib"])
            rows.append({"objective": objective, "ranks": ranks, **{k: top[k] for k in (
                "held_mib", "step_mib", "peak_mib", "process_hwm_mib", "models", "param_bytes", "live_param_bytes")},
                "step_s": max(r["step_s"] for r in ranks)})
            print(f"{objective}: peak {top['peak_mib']:.0f} MiB per rank (held {top['held_mib']:.0f} + step "
                  f"{top['step_mib']:.0f}), {top['models']} model(s), step {rows[-1]['step_s']:.1f} s", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = next(r for r in rows if r["objective"] == "sft")
    lines = ["| objective | held MiB | step MiB | peak MiB per rank | vs SFT | process peak MiB | models | "
             "parameters MiB (engine / all live) | step s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['objective']} | {r['held_mib']:.0f} | {r['step_mib']:.0f} | {r['peak_mib']:.0f} | "
                     f"{r['peak_mib'] / base['peak_mib']:.3f} | {r['process_hwm_mib']:.0f} | {r['models']} | "
                     f"{r['param_bytes'] / 2**20:.0f} / {r['live_param_bytes'] / 2**20:.0f} | {r['step_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "dpo_memory.json"))
    args = parser.parse_args()
    rows = run(args.stage, args.world, args.seq, args.micro, args.accumulation)
    Path(args.out).write_text(json.dumps({"model": MODEL, "args": vars(args), "rows": rows}, indent=2))
    print(table(rows))


if __name__ == "__main__":
    main()

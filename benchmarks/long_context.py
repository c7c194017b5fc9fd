"""Peak resident memory per rank of one training step at long sequences, DeepSpeed Ulysses (``zero.sp``)
against one rank holding the whole row, measured side by side in one run; with ``--tiles``, sequence
tiles (``zero.tiled_mlp`` + ``zero.tiled_loss``) against none on a wide model.

    python benchmarks/long_context.py                         # seq 8k, 16k, 32k; sp 1 and 2 (~10 min on 2 cores)
    python benchmarks/long_context.py --seqs 4096 --sps 1,2
    python benchmarks/long_context.py --tiles --seqs 4096,8192,16384 --sps 1   # tiles off / on, WIDE model

``--tiles`` runs the ``WIDE`` model (the same but intermediate 2048 and vocabulary 16384: the MLP's
[tokens, intermediate] and the [tokens, vocab] logits, which tiles bound, dominate) with tiles off and
on at each sequence length and sp, results to benchmarks/results/long_context_tiles.json.

A small-hidden Llama (hidden 128, 2 layers, 4 heads / 2 KV heads, vocabulary 256: the activations, not
the weights, dominate), fp32, ZeRO-0, one row per step, plain rows (causal: torch's CPU flash kernel, no
s x s scores). sp=1 runs on one rank, sp=2 on two (dp=1: each rank half of the row). Per rank: the
kernel's high-water mark of resident memory (VmHWM, reset through /proc/self/clear_refs after a first
warm-up step and glibc's malloc_trim) during a second step, above the RSS just before it: what the step itself adds
(activations, logits and loss, gradients, the all-to-all buffers). The table shows the fullest rank's
figure and its ratio to sp=1's at the same sequence length. Results: benchmarks/results/long_context.json.
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

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 256,
         "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
WIDE = {**MODEL, "intermediate_size": 2048, "vocab_size": 16384}


def _memory_mib() -> dict:
    status = Path("/proc/self/status").read_text().splitlines()
    kb = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss": kb["VmRSS"] / 1024, "hwm": kb["VmHWM"] / 1024}


def _rank(rank, world, model_dir, seq, sp, tiles=False, vocab=256):
    import torch

    from toolkit.adapters.deepspeed import DeepSpeedEngine, build_model
    from toolkit.config import validate
    from toolkit.plan import build_plan
    zero = {"stage": 0, "sp": sp, "tiled_mlp": tiles, "tiled_loss": tiles}
    cfg = validate({"model": {"name_or_path": model_dir}, "zero": zero,
                    "data": {"seq_len": seq, "packing": "concat"},
                    "train": {"global_batch_size": 1, "micro_batch_size": 1, "lr": 1e-4, "min_lr": 1e-5}})
    plan = build_plan(cfg, [world])
    engine = DeepSpeedEngine(plan, build_model(plan, plan.ds_config(world)))
    g = torch.Generator().manual_seed(0)
    mb = {"input_ids": torch.randint(1, vocab, (1, seq), generator=g),
          "labels": torch.randint(1, vocab, (1, seq), generator=g)}
    engine.train_step([mb], seq, 1e-4)  # warm-up: optimizer state, one-time buffers
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # the heap the warm-up freed goes back: the step's own peak is seen
    before = _memory_mib()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    tic = time.perf_counter()
    stats = engine.train_step([mb], seq, 1e-4)
    seconds = time.perf_counter() - tic
    after = _memory_mib()
    return {"step_peak_mib": after["hwm"] - before["rss"], "rss_before_mib": before["rss"], "step_s": seconds,
            "loss": stats.loss}


def run(seqs: list[int], sps: list[int], tiles: tuple[bool, ...] = (False,), model: dict = MODEL) -> list[dict]:
    from tests.helpers.ranks import run_ranks
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(model))
        for seq in seqs:
            for sp in sps:
                for tiled in tiles:
                    out = Path(tmp) / f"s{seq}_sp{sp}_t{int(tiled)}"
                    out.mkdir()
                    ranks = run_ranks(_rank, sp, out, str(model_dir), seq, sp, tiled, model["vocab_size"],
                                      timeout=1800)
                    rows.append({"seq": seq, "sp": sp, "tiles": tiled, "ranks": ranks,
                                 "peak_mib": max(r["step_peak_mib"] for r in ranks),
                                 "step_s": max(r["step_s"] for r in ranks)})
                    print(f"seq {seq} sp {sp} tiles {tiled}: peak {rows[-1]['peak_mib']:.0f} MiB per rank, "
                          f"step {rows[-1]['step_s']:.1f} s, loss {ranks[0]['loss']:.6f}", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    base = {r["seq"]: r["peak_mib"] for r in rows if r["sp"] == 1}
    lines = ["| seq | sp | peak MiB per rank (step) | vs sp=1 | step s |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['peak_mib'] / base[r['seq']]:.2f}" if r["seq"] in base else "-"
        lines.append(f"| {r['seq']} | {r['sp']} | {r['peak_mib']:.0f} | {ratio} | {r['step_s']:.1f} |")
    return "\n".join(lines)


def tiles_table(rows: list[dict]) -> str:
    off = {(r["seq"], r["sp"]): r["peak_mib"] for r in rows if not r["tiles"]}
    lines = ["| seq | sp | peak MiB per rank, no tiles | with tiles | ratio | step s no tiles / tiles |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if r["tiles"]:
            plain = next(x for x in rows if (x["seq"], x["sp"]) == (r["seq"], r["sp"]) and not x["tiles"])
            lines.append(f"| {r['seq']} | {r['sp']} | {off[r['seq'], r['sp']]:.0f} | {r['peak_mib']:.0f} | "
                         f"{r['peak_mib'] / off[r['seq'], r['sp']]:.2f} | {plain['step_s']:.1f} / {r['step_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="8192,16384,32768")
    parser.add_argument("--sps", default="1,2")
    parser.add_argument("--tiles", action="store_true", help="the WIDE model, zero.tiled_mlp+tiled_loss off and on")
    args = parser.parse_args()
    seqs, sps = [int(s) for s in args.seqs.split(",")], [int(s) for s in args.sps.split(",")]
    model = WIDE if args.tiles else MODEL
    rows = run(seqs, sps, (False, True) if args.tiles else (False,), model)
    out = REPO / "benchmarks" / "results" / ("long_context_tiles.json" if args.tiles else "long_context.json")
    out.write_text(json.dumps({"model": model, "rows": rows}, indent=2))
    print(tiles_table(rows) if args.tiles else table(rows))


if __name__ == "__main__":
    main()

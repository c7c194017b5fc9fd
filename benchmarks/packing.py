"""``data.packing`` documents vs pad vs concat on the instruct example, side by side (issue #22).

Each mode trains ``examples/instruct/config.yaml`` (demo tiny Llama, 2 ranks, ZeRO-2, seq 128,
global batch 16) for ``--steps`` steps; modes run interleaved (ABBA... over ``--rounds``) so load
drift cancels. Per mode, from ``metrics.jsonl`` (steps after ``--warmup``): median step time, row
tokens/s (``tokens_per_s``: global batch x seq_len per step, padding included), packing efficiency
(document tokens / row tokens), useful tokens/s (row tokens/s x efficiency), documents per row, and
the time of one epoch (train rows / global batch x median step): what each mode costs to see every
document once. ``concat`` has no padding but lets documents attend to each other (and cuts them at
row ends); ``documents`` keeps each document alone at close to concat's efficiency; ``pad`` is the
one-document-per-row reference.

    python benchmarks/packing.py                      # ~4 min on 2 cores (2 rounds x 3 modes x 40 steps)
    python benchmarks/packing.py --quick              # 1 round, 12 steps
Writes benchmarks/results/packing.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "packing.json"
MODES = ["documents", "pad", "concat"]


def train(run_dir: Path, mode: str, steps: int, cache: Path, backend: str) -> None:
    sets = [f"data.packing={mode}", f"train.steps={steps}", "train.eval_every=0", "train.log_every=1",
            "checkpoint.every=100000", "train.export_hf=false", f"data.cache_dir={cache}", "data.eval_fraction=0",
            f"backend={backend}"]
    cmd = [sys.executable, "-m", "toolkit", "train", "examples/instruct/config.yaml", "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, text=True,
                   env={**os.environ, "OMP_NUM_THREADS": "1"})


def read(run_dir: Path, warmup: int) -> dict:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r and r["step"] > warmup]
    packing = next(r for r in records if r.get("event") == "packing")
    return {"step_s": [r["step_s"] for r in steps], "tokens_per_s": [r["tokens_per_s"] for r in steps],
            "efficiency": [r["packing_efficiency"] for r in steps], "per_row": [r.get("documents_per_row") for r in steps],
            "train_rows": packing["train_rows"], "documents": packing["documents"],
            "overflow": packing["overflow_documents"]}


def summarize(runs: list[dict], global_batch: int) -> dict:
    step_s = statistics.median(x for r in runs for x in r["step_s"])
    tps = statistics.median(x for r in runs for x in r["tokens_per_s"])
    eff = statistics.mean(x for r in runs for x in r["efficiency"])
    per_row = [x for r in runs for x in r["per_row"] if x is not None]  # concat: documents / rows of the corpus
    per_row = statistics.mean(per_row) if per_row else runs[0]["documents"] / runs[0]["train_rows"]
    return {"median_step_s": round(step_s, 4), "row_tokens_per_s": round(tps), "packing_efficiency": round(eff, 4),
            "useful_tokens_per_s": round(tps * eff), "documents_per_row": round(per_row, 2), "train_rows": runs[0]["train_rows"],
            "epoch_s": round(runs[0]["train_rows"] / global_batch * step_s, 1), "overflow_documents": runs[0]["overflow"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--backend", default="deepspeed", choices=["deepspeed", "megatron"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", type=Path, default=RESULT)
    args = ap.parse_args()
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 12, 2
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for r in range(args.rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                run_dir = work / f"{mode}-{r}"
                train(run_dir, mode, args.steps, work / "cache", args.backend)
                runs[mode].append(read(run_dir, args.warmup))
                print(f"round {r} {mode}: median step {statistics.median(runs[mode][-1]['step_s']):.3f} s", flush=True)
    result = {"modes": {m: summarize(runs[m], 16) for m in MODES}, "backend": args.backend, "rounds": args.rounds,
              "steps": args.steps, "warmup": args.warmup, "wall_s": round(time.time() - started),
              "machine": platform.node(), "date": time.strftime("%Y-%m-%d")}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| mode | step s | row tokens/s | packing efficiency | useful tokens/s | documents/row | train rows | epoch s |")
    print("|---|---|---|---|---|---|---|---|")
    for m, s in result["modes"].items():
        print(f"| {m} | {s['median_step_s']:.3f} | {s['row_tokens_per_s']:,} | {s['packing_efficiency']:.3f} | "
              f"{s['useful_tokens_per_s']:,} | {s['documents_per_row']:.2f} | {s['train_rows']} | {s['epoch_s']} |")


if __name__ == "__main__":
    main()

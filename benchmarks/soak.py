"""Soak the restart policy: one job through M random faults, against the same job uninterrupted.

    python benchmarks/soak.py --faults 4 --steps 24 --seed 0

Reports recoveries, steps lost (steps computed twice because they were rolled back), time to
recover (failure event -> first finished step after the restart) and whether the final losses equal
the uninterrupted run's bit for bit. Writes benchmarks/results/soak.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
KINDS = ["kill", "raise", "hang", "kill_in_save", "corrupt", "abort", "sigterm", "sigint", "enospc"]
PREEMPTED_EXIT = 75  # sigterm, sigint: the job saved and stopped; the same command resumes it


def train(run_dir: Path, steps: int, every: int, faults: str, max_restarts: int) -> float:
    sets = ["data.seq_len=32", f"train.steps={steps}", "train.global_batch_size=8", "train.micro_batch_size=2",
            "train.warmup_steps=2", "train.eval_every=0", f"checkpoint.every={every}", "checkpoint.keep_last=3",
            f"restart.max_restarts={max_restarts}", "restart.backoff_s=0.5", "restart.hang_timeout_s=10"]
    cmd = [sys.executable, "-m", "toolkit", "train", "--run-dir", str(run_dir), "--nproc", "2"]
    for s in sets:
        cmd += ["--set", s]
    tic = time.perf_counter()
    code = PREEMPTED_EXIT
    while code == PREEMPTED_EXIT:  # preempted: run the same command again, as a scheduler would
        code = subprocess.run(cmd, cwd=REPO, env={**os.environ, "TOOLKIT_FAULT": faults}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=3600).returncode
    if code:
        raise SystemExit(f"soak: toolkit train exited {code}; events in {run_dir}/events.jsonl")
    return time.perf_counter() - tic


def random_faults(n: int, steps: int, every: int, rng: random.Random) -> str:
    chosen = []
    for step in sorted(rng.sample(range(2, steps), n)):
        kind = rng.choice(KINDS)
        if kind in ("kill_in_save", "corrupt", "enospc"):
            step = max(every, step // every * every)  # these act on a checkpoint step
        chosen.append(f"{kind}:step={step}:rank={rng.randrange(2) if kind != 'corrupt' else 0}")
    return ";".join(dict.fromkeys(chosen))


def summarize(run_dir: Path, baseline: Path, steps: int) -> dict:
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    computed = sum(1 for r in records if "loss" in r)
    final = {r["step"]: r["loss"] for r in records if "loss" in r}
    base = {r["step"]: r["loss"] for r in map(json.loads, (baseline / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}
    recover = [e["time_to_recover_s"] for e in events if e["kind"] == "recovered" and e["time_to_recover_s"]]
    return {"restarts": sum(e["kind"] == "restart" for e in events),
            "hangs": sum(e["kind"] == "hang" for e in events),
            "preemptions": sum(e["kind"] == "preempt_saved" for e in events),
            "checkpoints_failed": sum(e["kind"] == "checkpoint_failed" for e in events),
            "checkpoints_skipped": sum(e["kind"] == "checkpoint_skipped" for e in events),
            "steps_lost": computed - steps,
            "time_to_recover_s": {"mean": round(statistics.mean(recover), 2) if recover else None,
                                  "max": round(max(recover), 2) if recover else None},
            "losses_equal_uninterrupted": final == base,
            "max_rel_loss_diff": max(abs(final[k] - base[k]) / abs(base[k]) for k in base)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--faults", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work-dir", help="parent of the temporary run directories")
    args = p.parse_args()
    faults = random_faults(args.faults, args.steps, args.every, random.Random(args.seed))
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp:
        base_s = train(Path(tmp) / "base", args.steps, args.every, "", 0)
        soak_s = train(Path(tmp) / "soak", args.steps, args.every, faults, args.faults + 2)
        result = {"faults": faults, "wall_s": {"uninterrupted": round(base_s, 1), "with_faults": round(soak_s, 1)},
                  **summarize(Path(tmp) / "soak", Path(tmp) / "base", args.steps),
                  "command": " ".join(sys.argv), "machine": platform.platform(), "cpus": os.cpu_count()}
    out = REPO / "benchmarks" / "results" / "soak.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    for key, value in result.items():
        print(f"{key:28s} {value}")


if __name__ == "__main__":
    main()

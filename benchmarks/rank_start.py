"""How ranks start: forked from a preloaded forkserver vs spawned as ``python -m toolkit.train.worker``.

Cases: a tiny 2-rank ``toolkit train`` (the demo model, seq 32, 6 steps, one checkpoint) on each
backend (DeepSpeed ZeRO-2; megatron TP=2), with ``TOOLKIT_RANK_START=forkserver`` and ``=spawn``, and
the same DeepSpeed job with rank 1 killed at step 4 and one restart (``time_to_recover_s`` from
events.jsonl: the failure to the first step after the restart). CPU seconds are the machine's
(``/proc/stat`` busy time over the run: the forkserver's ranks are not the launcher's waited-for
children, so ``getrusage`` would miss them); run on an otherwise idle machine. Rounds alternate the
order of the two modes (ABBA) so load drift cancels in the ratios.

    python benchmarks/rank_start.py            # ~4 min on 2 cores (2 rounds)
Writes benchmarks/results/rank_start.json (or --out) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ["data.seq_len=32", "train.steps=6", "train.global_batch_size=8", "train.micro_batch_size=2",
        "train.warmup_steps=2", "train.eval_every=0", "checkpoint.every=3", "train.log_every=1"]
CASES = {
    "deepspeed": ["zero.stage=2"],
    "megatron_tp2": ["backend=megatron", "megatron.tp=2"],
    "deepspeed_kill_restart": ["zero.stage=2", "restart.max_restarts=1", "restart.backoff_s=0.2"],
}
FAULTS = {"deepspeed_kill_restart": "kill:step=4:rank=1"}
MODES = ("forkserver", "spawn")


def busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine (user + nice + system + irq + softirq)."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = os.sysconf("SC_CLK_TCK")
    return sum(int(fields[i]) for i in (0, 1, 2, 5, 6)) / ticks


def run_case(case: str, mode: str, root: Path, cache: Path) -> dict:
    run_dir = root / f"{case}-{mode}-{time.monotonic_ns()}"
    args = [sys.executable, "-m", "toolkit", "train", "--run-dir", str(run_dir), "--nproc", "2"]
    for s in [*TINY, f"data.cache_dir={cache}", *CASES[case]]:
        args += ["--set", s]
    env = {**os.environ, "TOOLKIT_RANK_START": mode, "PYTHONUNBUFFERED": "1"}
    if case in FAULTS:
        env["TOOLKIT_FAULT"] = FAULTS[case]
    cpu0, t0 = busy_cpu_s(), time.perf_counter()
    proc = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    wall, cpu = time.perf_counter() - t0, busy_cpu_s() - cpu0
    if proc.returncode != 0:
        raise RuntimeError(f"{case} {mode} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()] \
        if (run_dir / "events.jsonl").exists() else []
    recover = [e["time_to_recover_s"] for e in events if e["kind"] == "recovered"]
    return {"wall_s": wall, "cpu_s": cpu, "recover_s": recover[0] if recover else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "rank_start.json"))
    args = parser.parse_args()
    results: dict = {case: {mode: [] for mode in MODES} for case in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        root, cache = Path(tmp), Path(tmp) / "cache"
        run_case("deepspeed", "spawn", root, cache)  # tokenizer and data cache, DeepSpeed's ops: not timed
        for r in range(args.rounds):
            for case in CASES:
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    results[case][mode].append(run_case(case, mode, root, cache))
    table = {case: {mode: {key: statistics.median(x[key] for x in runs) if runs[0][key] is not None else None
                           for key in ("wall_s", "cpu_s", "recover_s")} for mode, runs in modes.items()}
             for case, modes in results.items()}
    print(f"{'case':<24}{'mode':<12}{'wall s':>8}{'CPU s':>8}{'recover s':>11}")
    for case, modes in table.items():
        for mode, m in modes.items():
            rec = f"{m['recover_s']:.1f}" if m["recover_s"] is not None else "-"
            print(f"{case:<24}{mode:<12}{m['wall_s']:>8.1f}{m['cpu_s']:>8.1f}{rec:>11}")
        f, s = modes["forkserver"], modes["spawn"]
        print(f"{'':<24}{'ratio':<12}{f['wall_s'] / s['wall_s']:>8.2f}{f['cpu_s'] / s['cpu_s']:>8.2f}")
    Path(args.out).write_text(json.dumps({"cpu_count": os.cpu_count(), "rounds": args.rounds, "median": table,
                                          "runs": results}, indent=1))


if __name__ == "__main__":
    main()

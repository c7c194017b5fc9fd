"""Checkpoint save/load time through ``toolkit train``: ZeRO-2, ZeRO-3 (DeepSpeed) and Megatron TP=2.

A Llama-shaped model (default ~219M parameters: hidden 1024, 12 layers, MLP 2816, vocab 32000,
untied; --quick: ~21M) is trained on 2 local CPU ranks (gloo) exactly as users run it::

  python -m toolkit train --nproc 2 --run-dir RUN --set model.name_or_path=MODEL --set train.steps=4 \\
      --set checkpoint.every=2 [--set checkpoint.async_save=true --set checkpoint.local_dir=/dev/shm] ...

Per case (zero2, zero3, megatron):
  sync    a fresh run, 4 steps, a save at steps 2 and 4 (staging dir, fsync, sha256 manifest, rename):
          ``checkpoint_blocked_s`` of each save from metrics.jsonl
  async   the same run with ``checkpoint.async_save=true`` (snapshot to /dev/shm, persisted by a
          thread): ``checkpoint_blocked_s`` and the background persist time (rank 0's log line
          "persisted checkpoint ... in the background (X s after the step went on)")
  resume  the sync run started again with train.steps=5 after its files were evicted from the page
          cache (posix_fadvise DONTNEED): it verifies the newest checkpoint's sha256 manifest, loads it
          (DeepSpeed ``engine.load_checkpoint`` / megatron ``dist_checkpointing.load``) and trains one
          step. Load time = (launch -> rank 0's "resumed from" line) minus (launch -> the "no complete
          checkpoint found" line of the fresh sync run, printed at the same point of the loop);
          both lines are timestamped as they arrive on the launcher's stdout. Startup (imports,
          random init of the model, engine build) is in both and cancels, up to its run-to-run noise
          (a few seconds on a busy machine). The manifest check (sha256 of every byte) is part of
          every resume; it is also timed alone here (``verify_complete`` on cold files), so the
          engine's own load is about the difference.
  baseline  the same bytes through ``cp -r`` (source in the page cache, as the engine's tensors are
          in memory), also with an fsync of every copied file (``sync FILES``: the toolkit fsyncs),
          and ``cat FILES > /dev/null`` on cold files (the read a load cannot avoid).

Figures are wall times on this machine (2 cores shared with other jobs); MB/s = checkpoint bytes
(10^6) / seconds. Writes benchmarks/results/checkpoint_io.json and prints a table.

  python benchmarks/checkpoint_io.py [--quick] [--cases zero2,zero3,megatron] [--workdir DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {
    "default": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16,
                    num_key_value_heads=16, vocab_size=32000),
    "quick": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=8, vocab_size=8000),
}
CASES = {
    "zero2": ["backend=deepspeed", "zero.stage=2"],
    "zero3": ["backend=deepspeed", "zero.stage=3"],
    "megatron": ["backend=megatron", "megatron.tp=2"],
}
STEPS, EVERY = 4, 2


def model_config(shape: dict) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "initializer_range": 0.02,
            "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "bos_token_id": 0,
            "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "float32", **shape}


def num_params(s: dict) -> int:
    h, i, n, v = s["hidden_size"], s["intermediate_size"], s["num_hidden_layers"], s["vocab_size"]
    kv = h * s["num_key_value_heads"] // s["num_attention_heads"]
    layer = h * h * 2 + 2 * h * kv + 3 * h * i + 2 * h
    return n * layer + 2 * v * h + h


def train(run_dir: Path, sets: list[str], steps: int) -> dict:
    """One ``toolkit train`` launch; stdout lines with their arrival time (seconds after the launch)."""
    cmd = [sys.executable, "-m", "toolkit", "train", "--nproc", "2", "--run-dir", str(run_dir),
           *[a for s in sets + [f"train.steps={steps}"] for a in ("--set", s)]]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    tic = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True)
    lines = []
    for line in proc.stdout:
        lines.append((time.perf_counter() - tic, line.rstrip()))
    rc = proc.wait()
    wall = time.perf_counter() - tic
    if rc != 0:
        tail = "\n".join(text for _, text in lines[-40:])
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{tail}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"cmd": cmd, "wall_s": wall, "lines": lines, "rows": rows}


def first_line(run: dict, pattern: str) -> tuple[float, str] | None:
    return next(((t, s) for t, s in run["lines"] if re.search(pattern, s)), None)


def evict(path: Path) -> None:
    """Drop the files' pages from the page cache (they are clean: the toolkit fsynced them)."""
    for f in (p for p in path.rglob("*") if p.is_file()):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def timed(cmd: str) -> float:
    tic = time.perf_counter()
    subprocess.run(cmd, shell=True, check=True)
    return time.perf_counter() - tic


def baselines(ckpt: Path, scratch: Path) -> dict:
    out = {}
    for fsync in (False, True):
        dst = scratch / "cp"
        shutil.rmtree(dst, ignore_errors=True)
        cmd = f"cp -r '{ckpt}' '{dst}'"
        if fsync:  # coreutils sync FILE... fsyncs each named file
            cmd += f" && find '{dst}' -type f -exec sync {{}} +"
        out["cp_fsync_s" if fsync else "cp_s"] = timed(cmd)
        shutil.rmtree(dst, ignore_errors=True)
    evict(ckpt)
    out["cat_cold_s"] = timed(f"find '{ckpt}' -type f -exec cat {{}} + > /dev/null")
    from toolkit.storage import verify_complete
    evict(ckpt)
    tic = time.perf_counter()
    problems = verify_complete(ckpt)
    out["verify_sha256_cold_s"] = time.perf_counter() - tic
    assert not problems, problems
    return out


def run_case(name: str, common: list[str], work: Path) -> dict:
    sets = common + CASES[name]
    sync_dir, async_dir = work / f"{name}_sync", work / f"{name}_async"
    for d in (sync_dir, async_dir):
        shutil.rmtree(d, ignore_errors=True)
    print(f"[{name}] sync run ...", flush=True)
    sync = train(sync_dir, sets, STEPS)
    ckpt = sync_dir / "checkpoints" / f"step_{STEPS:08d}"
    nbytes = dir_bytes(ckpt)
    nfiles = sum(1 for p in ckpt.rglob("*") if p.is_file())
    base = baselines(ckpt, work)
    print(f"[{name}] async run ...", flush=True)
    asyn = train(async_dir, sets + ["checkpoint.async_save=true", "checkpoint.local_dir=/dev/shm"], STEPS)
    shutil.rmtree(async_dir / "checkpoints", ignore_errors=True)
    from toolkit.checkpoint.async_save import local_root
    shutil.rmtree(local_root("/dev/shm", async_dir), ignore_errors=True)  # the (empty) snapshot folder
    print(f"[{name}] resume run (cold page cache) ...", flush=True)
    evict(sync_dir / "checkpoints")
    resume = train(sync_dir, sets, STEPS + 1)
    shutil.rmtree(sync_dir / "checkpoints", ignore_errors=True)

    saves = lambda run: [r for r in run["rows"] if r.get("event") == "checkpoint"]  # noqa: E731
    persisted = [float(m.group(1)) for _, s in asyn["lines"]
                 if (m := re.search(r"persisted checkpoint .* in the background \(([\d.]+) s after", s))]
    fresh_mark = first_line(sync, r"no complete checkpoint found")
    resumed_mark = first_line(resume, r"resumed from step_")
    load_cli = resumed_mark[0] - fresh_mark[0] if fresh_mark and resumed_mark else None
    sync_blocked = [r["checkpoint_blocked_s"] for r in saves(sync)]
    async_blocked = [r["checkpoint_blocked_s"] for r in saves(asyn)]
    step_s = lambda run: [round(r["step_s"], 3) for r in run["rows"] if "loss" in r]  # noqa: E731
    return {
        "case": name, "sets": sets, "checkpoint_bytes": nbytes,
        "checkpoint_files": nfiles,
        "sync": {"cmd": " ".join(sync["cmd"][1:]), "wall_s": sync["wall_s"], "blocked_s": sync_blocked,
                 "step_s": step_s(sync)},
        "async": {"cmd": " ".join(asyn["cmd"][1:]), "wall_s": asyn["wall_s"], "blocked_s": async_blocked,
                  "persist_s": persisted, "step_s": step_s(asyn)},
        "resume": {"cmd": " ".join(resume["cmd"][1:]), "wall_s": resume["wall_s"],
                   "launch_to_resumed_s": resumed_mark[0] if resumed_mark else None,
                   "fresh_launch_to_no_checkpoint_s": fresh_mark[0] if fresh_mark else None,
                   "load_incl_verify_s": load_cli},
        "baseline": base,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~21M-parameter model (~2 min)")
    ap.add_argument("--cases", default="zero2,zero3,megatron")
    ap.add_argument("--workdir", default="/tmp/toolkit_bench_ckpt")
    ap.add_argument("--out", default=None, help="default: benchmarks/results/checkpoint_io[_quick].json")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    args = ap.parse_args()
    shape = MODELS["quick" if args.quick else "default"]
    work = Path(args.workdir)
    shutil.rmtree(work, ignore_errors=True)
    (work / "model").mkdir(parents=True)
    (work / "model" / "config.json").write_text(json.dumps(model_config(shape), indent=2))
    common = [f"model.name_or_path={work / 'model'}", f"data.cache_dir={work / 'data_cache'}",
              "data.seq_len=32", "train.global_batch_size=2", "train.micro_batch_size=1",
              "train.warmup_steps=1", "train.eval_every=0", "train.log_every=1", f"checkpoint.every={EVERY}",
              "checkpoint.keep_last=2", "restart.straggler_every=0", "restart.divergence_every=0"]
    tic = time.perf_counter()
    results = []
    try:
        for name in args.cases.split(","):
            results.append(run_case(name, common, work))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    report = {
        "benchmark": "checkpoint_io", "time_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_avg_at_end": os.getloadavg(), "run_dir_fs": "same disk as --workdir",
                    "local_dir": "/dev/shm (tmpfs)"},
        "versions": _versions(), "command": " ".join([sys.executable, *sys.argv]),
        "model": {**shape, "params": num_params(shape), "dtype": "fp32"},
        "steps": STEPS, "checkpoint_every": EVERY, "total_wall_s": round(time.perf_counter() - tic, 1),
        "cases": results,
    }
    out = Path(args.out or REPO / "benchmarks" / "results" / f"checkpoint_io{'_quick' if args.quick else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"wrote {out}")
    return 0


def _versions() -> dict:
    from importlib.metadata import version
    out = {}
    for pkg in ("torch", "deepspeed", "megatron-core", "transformers", "datasets"):
        try:
            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001
            out[pkg] = None
    return out


def print_table(report: dict) -> None:
    m = report["model"]
    print(f"\nmodel: {m['params'] / 1e6:.0f}M params fp32, 2 ranks, saves at steps "
          f"{list(range(report['checkpoint_every'], report['steps'] + 1, report['checkpoint_every']))}")
    print("| case | GB | sync save s (MB/s) | cp -r s | cp -r+fsync s | save / cp+fsync | async blocked s | "
          "async persist s | load s (MB/s) | sha256 verify s | cat cold s | load / cat |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in report["cases"]:
        mb = c["checkpoint_bytes"] / 1e6
        b = c["baseline"]
        sync = c["sync"]["blocked_s"][-1]
        load = c["resume"]["load_incl_verify_s"]
        fmt = lambda xs: "/".join(f"{x:.2f}" for x in xs)  # noqa: E731
        print(f"| {c['case']} | {mb / 1e3:.2f} | {fmt(c['sync']['blocked_s'])} ({mb / sync:.0f}) | {b['cp_s']:.2f} | "
              f"{b['cp_fsync_s']:.2f} | {sync / b['cp_fsync_s']:.2f} | {fmt(c['async']['blocked_s'])} | "
              f"{fmt(c['async']['persist_s'])} | "
              + (f"{load:.2f} ({mb / load:.0f})" if load else "n/a")
              + f" | {b['verify_sha256_cold_s']:.2f} | {b['cat_cold_s']:.2f} | "
              + (f"{load / b['cat_cold_s']:.2f} |" if load else "n/a |"))


if __name__ == "__main__":
    sys.exit(main())

"""GPU check: one command on a single-GPU machine that reaches no package registry.

    python3 benchmarks/gpu_check.py --out OUT                 # on the GPU machine (~8-10 min)
    python3 benchmarks/gpu_check.py --out OUT --rehearse      # on a CPU machine: the same phases, tiny

Phases, in order, each writing its result into ``OUT/results.json`` as soon as it ends (a run cut
short still leaves what it measured):
  1. environment: Python, torch, transformers, CUDA, the GPU, free disk (the GPU machine has its own
     torch and transformers, not the pinned ones: the results say which ran);
  2. set-up: what the machine lacks (DeepSpeed, megatron-core, datasets, pydantic, ...) installed from
     the wheels carried in ``.whl/`` into ``OUT/site`` (``benchmarks/gpu_wheels.py install``), never
     into the system site-packages;
  3. ``toolkit doctor``;
  4. the GPU test layer, ``pytest -m gpu tests/gpu`` (correctness first; log in OUT/gpu_tests.log);
  5. throughput: a ~1.1B Llama in bf16, one rank per backend (megatron TP=1, DeepSpeed ZeRO-1), the
     same seed and data, no checkpoints or exports (the disk is 64 GiB); tokens/s and MFU from the
     steps after warm-up, and the two backends' step-1 losses, which must agree within bf16 rounding;
  6. attention: one layer's attention, the toolkit's core attention vs megatron's local one, at seq
     1k/2k/4k in bf16 (``benchmarks/attention.py``: forward + backward time, saved and peak memory).
A short table ends the run.

MFU = achieved model FLOP/s / the GPU's dense bf16 peak (``toolkit/plan/flops.py``, the formula and peak
table ``toolkit train`` logs per step on GPUs): model FLOPs per token
``6 * N + 12 * n_layers * attention_width * seq_len`` (PaLM, appendix B), N without the input embedding.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEEDED = ("deepspeed", "megatron.core", "datasets", "pydantic", "einops", "rich", "yaml")

LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
            "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
LLAMA_TINY = {**LLAMA_1B, "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}
BACKENDS = {"megatron": ["backend=megatron", "megatron.tp=1"], "deepspeed": ["backend=deepspeed", "zero.stage=1"]}


class Check:
    """The run's results, written after every phase."""

    def __init__(self, out: Path, budget_s: float):
        self.out, self.deadline = out, time.monotonic() + budget_s
        self.results: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def record(self, phase: str, value) -> None:
        self.results[phase] = value
        (self.out / "results.json").write_text(json.dumps(self.results, indent=2))
        print(f"[gpu_check] {phase}: {json.dumps(value)[:400]}", flush=True)

    def run(self, cmd: list[str], log: str, timeout: float) -> tuple[int | str, str]:
        """``cmd`` with its output in OUT/log; exit code, or "timeout"."""
        started = time.monotonic()
        with open(self.out / log, "w") as f:
            try:
                code = subprocess.run(cmd, cwd=REPO, env=self.env, stdout=f, stderr=subprocess.STDOUT,
                                      timeout=max(timeout, 1)).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        print(f"[gpu_check] {' '.join(cmd[:6])} ... -> {code} in {time.monotonic() - started:.0f} s", flush=True)
        return code, (self.out / log).read_text()


def environment(check: Check) -> dict:
    info = {"python": platform.python_version(), "disk_free_gib": round(shutil.disk_usage(REPO).free / 2**30, 1)}
    try:
        import torch
        info.update(torch=torch.__version__, cuda=torch.version.cuda, gpu=torch.cuda.get_device_name()
                    if torch.cuda.is_available() else None)
        import transformers
        info["transformers"] = transformers.__version__
    except ImportError as exc:
        info["error"] = f"{exc}"
    return info


def set_up(check: Check, rehearse: bool) -> dict:
    """Install what the machine lacks from .whl/ into OUT/site; the rehearsal only checks the bundle."""
    missing = [m for m in NEEDED if not _importable(m)]
    if rehearse:
        code, _ = check.run([sys.executable, "benchmarks/gpu_wheels.py", "check"], "setup.log", check.left())
        return {"missing_here": missing, "bundle_check": code}
    if not missing:
        return {"installed": [], "note": "everything importable already"}
    site = check.out / "site"
    code, log = check.run([sys.executable, "benchmarks/gpu_wheels.py", "install", str(site)], "setup.log", check.left())
    if code != 0:
        raise SystemExit(f"set-up failed ({code}); see {check.out / 'setup.log'}:\n{log[-2000:]}")
    check.env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO), check.env.get("PYTHONPATH", "")])
    sys.path[:0] = [str(site), str(REPO)]
    still = [m for m in NEEDED if not _importable(m)]
    return {"installed_into": str(site), "was_missing": missing, "still_missing": still}


def _importable(module: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def gpu_tests(check: Check, rehearse: bool) -> dict:
    if rehearse:
        check.env["TOOLKIT_GPU_TESTS_ON_CPU"] = "1"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-v", "-s", "-p", "no:cacheprovider",
           f"--junitxml={check.out / 'gpu_tests.xml'}"]
    if rehearse:  # the rehearsal checks the code paths, not every case
        cmd += ["-k", "fp32 and llama or doctor or moe"]
    code, log = check.run(cmd, "gpu_tests.log", min(check.left() - 240, 420))
    summary = [line for line in log.splitlines() if " passed" in line or " failed" in line or " error" in line]
    return {"exit": code, "summary": summary[-1] if summary else None,
            "measured": [line.strip() for line in log.splitlines() if " rel " in line or "losses" in line][:40]}


def throughput(check: Check, name: str, args, config: dict) -> dict:
    """One backend on one rank: tokens/s, MFU and the first losses from its metrics.jsonl."""
    model_dir = check.out / "llama"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(config))
    run_dir = check.out / "runs" / name
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = [f"model.name_or_path={model_dir}", f"model.dtype={args.dtype}", f"data.seq_len={args.seq_len}",
            f"train.steps={args.steps}", f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.micro_batch * args.accum}", "train.eval_every=0", "train.log_every=1",
            "train.warmup_steps=5", "checkpoint.every=0", "train.export_hf=false",
            f"data.cache_dir={check.out / 'data_cache'}", *BACKENDS[name]]
    cmd = [sys.executable, "-m", "toolkit", "train", "--nproc", "1", "--run-dir", str(run_dir), "--resume", "never"]
    for s in sets:
        cmd += ["--set", s]
    code, log = check.run(cmd, f"train_{name}.log", min(check.left() - 30, 300))
    rows = _metrics(run_dir)
    if code != 0 or not rows:
        return {"exit": code, "tail": log[-1500:]}
    timed = rows[args.warmup:] or rows
    mfu = [r["mfu"] for r in timed if r.get("mfu") is not None]
    return {"exit": code, "tokens_per_s": round(statistics.median(r["tokens_per_s"] for r in timed)),
            "mfu": round(statistics.median(mfu), 4) if mfu else None, "steps_timed": len(timed),
            "first_losses": [round(r["loss"], 5) for r in rows[:3]], "last_loss": round(rows[-1]["loss"], 5),
            "finite_and_falling": all(r["loss"] == r["loss"] for r in rows) and rows[-1]["loss"] < rows[0]["loss"]}


def attention(check: Check, rehearse: bool) -> dict:
    """benchmarks/attention.py on this device: per sequence length, median seconds and peak MiB of each."""
    out = check.out / "attention.json"
    args = ["--seq", "128", "256", "--repeats", "1"] if rehearse else ["--dtype", "bfloat16"]
    code, log = check.run([sys.executable, "benchmarks/attention.py", *args, "--out", str(out)], "attention.log",
                          min(check.left() - 15, 180))
    if code != 0 or not out.exists():
        return {"exit": code, "tail": log[-1500:]}
    rows = json.loads(out.read_text())["rows"]
    return {"exit": code, "rows": [{"seq": r["seq"], "median_s": r["median_s"],
                                    "peak_mib": {k: round(v / 2**20) for k, v in r["peak_bytes"].items()}} for r in rows]}


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if "loss" in r and "tokens_per_s" in r]


def table(results: dict) -> str:
    lines = ["", "| backend | tokens/s | MFU | step-1 loss | last loss |", "|---|---|---|---|---|"]
    for name in BACKENDS:
        r = results.get(f"throughput_{name}") or {}
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        first = r.get("first_losses", ["-"])[0]
        lines.append(f"| {name} | {r.get('tokens_per_s', r.get('exit', '-'))} | {mfu} | {first} | {r.get('last_loss', '-')} |")
    for r in (results.get("attention") or {}).get("rows", []):
        t, p = r["median_s"], r["peak_mib"]
        lines.append(f"attention seq {r['seq']}: toolkit {t['toolkit']:.4f} s {p['toolkit']} MiB, "
                     f"local {t['local']:.4f} s {p['local']} MiB")
    tests = results.get("gpu_tests") or {}
    lines.append(f"\nGPU tests: {tests.get('summary')}; losses agree at step 1: {results.get('step1_agree')}")
    env = results.get("environment", {})
    lines.append(f"{env.get('gpu')}, torch {env.get('torch')}, transformers {env.get('transformers')}, "
                 f"CUDA {env.get('cuda')}, Python {env.get('python')}")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="results folder (OUT/results.json, logs, runs)")
    p.add_argument("--rehearse", action="store_true", help="on a CPU machine: tiny model, fp32, tests on the CPU")
    p.add_argument("--budget-s", type=float, default=560, help="stop starting phases after this long")
    p.add_argument("--skip-tests", action="store_true")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--dtype", default="bf16")
    args = p.parse_args()
    config = LLAMA_1B
    if args.rehearse:
        config, args.steps, args.warmup, args.seq_len, args.micro_batch, args.accum = LLAMA_TINY, 4, 1, 64, 2, 1
        args.dtype = "fp32"
    args.out.mkdir(parents=True, exist_ok=True)
    check = Check(args.out.resolve(), args.budget_s)
    check.record("environment", environment(check))
    check.record("setup", set_up(check, args.rehearse))
    code, log = check.run([sys.executable, "-m", "toolkit", "doctor"], "doctor.txt", 120)
    check.record("doctor", {"exit": code, "last": log.strip().splitlines()[-1] if log.strip() else None})
    if not args.skip_tests:
        check.record("gpu_tests", gpu_tests(check, args.rehearse))
    for name in BACKENDS:
        if check.left() < 60:
            check.record(f"throughput_{name}", {"exit": "no time left"})
            continue
        check.record(f"throughput_{name}", throughput(check, name, args, config))
    check.record("attention", attention(check, args.rehearse) if check.left() > 45 else {"exit": "no time left"})
    firsts = [check.results[f"throughput_{n}"].get("first_losses", [None])[0] for n in BACKENDS]
    if None not in firsts:
        check.record("step1_agree", abs(firsts[0] - firsts[1]) <= 2e-2 * abs(firsts[1]))  # bf16 rounding
    text = table(check.results)
    (check.out / "summary.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check: the Megatron path and the DeepSpeed path on one GPU, ~1B Llama-shaped model, bf16.

    python benchmarks/gpu_check.py [--steps 30] [--seq-len 2048] [--micro-batch 4] [--out result.json]
    python benchmarks/gpu_check.py --tiny      # a seconds-long smoke run of the same code (CPU is fine)

Each backend runs as a user runs it (``toolkit train``, 1 rank, random init from the same seed, the
demo corpus) and the script prints tokens/s and MFU from the steps after warm-up, plus the first
losses of both paths (same weights and data: they must agree to bf16 rounding).

MFU = achieved model FLOP/s / the GPU's dense peak for the dtype, with the formula and peak table of
toolkit/flops.py (the same MFU `toolkit train` logs per step on GPUs): model FLOPs per token
    6 * N + 12 * n_layers * attention_width * seq_len   (PaLM, appendix B)
where N counts all parameters except the input embedding. ``--peak-tflops`` overrides the peak.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from toolkit.estimate import model_shape  # noqa: E402
from toolkit.flops import flops_per_token, peak_flops  # noqa: E402

LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000,
            "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "bfloat16"}
LLAMA_TINY = {**LLAMA_1B, "vocab_size": 2048, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}


def hf_config(c: dict):
    from transformers import LlamaConfig
    return LlamaConfig(**{k: v for k, v in c.items() if k not in ("architectures", "model_type")})


def peak_tflops(override: float | None, dtype: str) -> float | None:
    """Dense peak of this GPU for ``dtype`` (toolkit/flops.py's table); None when unknown."""
    if override:
        return override
    peak = peak_flops(dtype)
    return peak / 1e12 if peak else None


def run_backend(name: str, overrides: list[str], model_dir: Path, args, work: Path) -> dict:
    run_dir = work / name
    sets = [f"model.name_or_path={model_dir}", f"model.dtype={args.dtype}", f"data.seq_len={args.seq_len}",
            f"train.steps={args.steps}", f"train.micro_batch_size={args.micro_batch}",
            f"train.global_batch_size={args.micro_batch * args.accum}", "train.eval_every=0",
            f"checkpoint.every={args.steps + 1}", "train.log_every=1", "train.warmup_steps=5", *overrides]
    cmd = [sys.executable, "-m", "toolkit", "train", "--nproc", "1", "--run-dir", str(run_dir), "--resume", "never"]
    for s in sets:
        cmd += ["--set", s]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode:
        raise SystemExit(f"{name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    steps = [r for r in rows if "loss" in r and "tokens_per_s" in r]
    timed = steps[args.warmup:] or steps
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
            "first_losses": [round(r["loss"], 5) for r in steps[:3]]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="2-layer model, 4 steps: check the script itself")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--peak-tflops", type=float)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    config = LLAMA_1B
    if args.tiny:
        config, args.steps, args.warmup, args.seq_len, args.micro_batch, args.accum = LLAMA_TINY, 4, 1, 32, 2, 1
        args.dtype = args.dtype if args.dtype != "bf16" else "fp32"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = work / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(config))
        results = {"megatron": run_backend("megatron", ["backend=megatron"], model_dir, args, work),
                   "deepspeed": run_backend("deepspeed", ["backend=deepspeed", "zero.stage=1"], model_dir, args, work)}
    fpt, peak = flops_per_token(hf_config(config), args.seq_len), peak_tflops(args.peak_tflops, args.dtype)
    for r in results.values():
        r["mfu"] = r["tokens_per_s"] * fpt / (peak * 1e12) if peak else None
    summary = {"model_params": model_shape(hf_config(config)).total, "flops_per_token": fpt, "peak_tflops": peak,
               "seq_len": args.seq_len, "micro_batch": args.micro_batch, "dtype": args.dtype, **results}
    for name, r in results.items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a (no GPU peak known)"
        print(f"{name:9s} {r['tokens_per_s']:10.0f} tokens/s  MFU {mfu}  first losses {r['first_losses']}")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

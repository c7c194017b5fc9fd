"""Mixture of experts on 2 CPU ranks (gloo): step time and communicated bytes of ZeRO-3 with the HF MoE
block as it is (every rank runs every expert, gathering each), ZeRO EP=2 (``zero.ep=2``: DeepSpeed's
AutoEP, at ZeRO-2 and ZeRO-3) and megatron EP=2 (allgather dispatcher), issue #45.

Model: a Mixtral of 8 experts (top-2), hidden 128, expert width 256, 2 layers; the demo corpus at
seq_len 128, 4 rows per rank per step in micro-batches of 2, fp32. Each case is ``toolkit train`` with
the toolkit's profiler on steps 4-6 (``toolkit/observe/profile.py``: rank 0's step time, its time in
collectives and the bytes per collective kind from the torch.profiler trace; "other" is what the
profiler does not name, here AutoEP's all-to-alls and megatron's dispatcher). On 2 shared cores the times
are indicative; the bytes are exact.

  python benchmarks/moe_ep.py                  # ~3 min; writes benchmarks/results/moe_ep.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MIXTRAL8 = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 128,
            "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 2048, "max_position_embeddings": 128, "num_local_experts": 8, "num_experts_per_tok": 2,
            "router_aux_loss_coef": 0.02, "tie_word_embeddings": False, "pad_token_id": 0}
CASES = {
    "zero3_moe": ["zero.stage=3"],
    "zero2_ep2": ["zero.stage=2", "zero.ep=2"],
    "zero3_ep2": ["zero.stage=3", "zero.ep=2"],
    "megatron_ep2": ["backend=megatron", "megatron.ep=2"],
}
COMMON = ["data.seq_len=128", "train.steps=7", "train.global_batch_size=8", "train.micro_batch_size=2",
          "checkpoint.every=100", "train.export_hf=false", "profile.enabled=true", "profile.start_step=4",
          "profile.steps=3"]


def run_case(name: str, overrides: list[str], root: Path) -> dict:
    run_dir = root / name
    args = [sys.executable, "-m", "toolkit", "train", "--run-dir", str(run_dir), "--nproc", "2", "--resume", "never"]
    for s in [f"model.name_or_path={root / 'model'}", f"data.cache_dir={root / 'data'}", *COMMON, *overrides]:
        args += ["--set", s]
    subprocess.run(args, cwd=REPO, check=True, capture_output=True, text=True)
    summary = json.loads((run_dir / "profile" / "summary_rank_00000.json").read_text())
    kinds = summary["collectives"]
    return {"step_ms": round(summary["step_ms"], 1), "comm_ms": round(summary["comm_ms"], 1),
            "mb_per_step": {k: round(v["mb_per_step"], 3) for k, v in sorted(kinds.items())},
            "total_mb_per_step": round(sum(v["mb_per_step"] for v in kinds.values()), 3)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "moe_ep.json")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "model").mkdir()
        (root / "model" / "config.json").write_text(json.dumps(MIXTRAL8))
        results = {name: run_case(name, overrides, root) for name, overrides in CASES.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": MIXTRAL8, "settings": COMMON, "results": results}, indent=2) + "\n")
    print("| case | step ms | in collectives ms | MB per step (rank 0) | by kind |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        kinds = ", ".join(f"{k} {v}" for k, v in r["mb_per_step"].items())
        print(f"| {name} | {r['step_ms']} | {r['comm_ms']} | {r['total_mb_per_step']} | {kinds} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

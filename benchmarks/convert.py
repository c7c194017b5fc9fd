"""Checkpoint conversion benchmark: ours vs DeepSpeed's zero_to_fp32 vs a plain copy.

Builds (once, cached in --workdir) a real ZeRO-3 checkpoint of a Llama-shaped ~134M-parameter
model written by DeepSpeed at DP=2 on CPU (one AdamW step, so Adam moments are in it), then runs,
each in its own process, measuring wall time and peak RSS (``os.wait4``'s ru_maxrss of that process):
  zero_to_fp32        python -m deepspeed.utils.zero_to_fp32 CKPT OUT --safe_serialization
  ours_zero_to_hf     python -m toolkit convert CKPT OUT --to hf
  ours_zero_to_mcore  python -m toolkit convert CKPT OUT --to megatron --tp 2 --pp 2
                      (weights, fp32 main weights and both Adam moments: 4x the bytes of the others)
  ..._weights_only    the same with --weights-only (what zero_to_fp32 writes: weights)
  copy                cp -r CKPT OUT  (reading and writing the same bytes, nothing else)
Each is run --repeats times; the best wall time and the largest peak RSS are reported (a child's
peak includes this process's RSS at the fork, ``parent_rss_mb``: the checkpoint is built in a child
so that stays ~15 MB). The HF output is checked tensor for tensor against zero_to_fp32's.

Memory section (``--sections memory``): every conversion path (``PATHS``: ZeRO, Megatron and HF
sources into each writer) on the same 134M model and on a tiny one of the same family (hidden 64,
2 layers, vocab 1000: the same imports and code, no tensor above 0.3 MB). The tiny run's peak RSS
is the path's *floor* (Python, torch, DCP, transformers' config, the CLI); the 134M run's peak minus
that floor is what the conversion itself holds at its worst, reported in MB and in units of the
model's largest tensor (the 98 MB fp32 embedding). Bounded memory means a few of those, whatever
the model size.

Writes benchmarks/results/convert.json.

  python benchmarks/convert.py [--workdir /tmp/toolkit_bench_convert] [--repeats 2] [--sections timing,memory]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONFIG = dict(model_type="llama", hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
              num_attention_heads=12, num_key_value_heads=12, vocab_size=32000, max_position_embeddings=512,
              tie_word_embeddings=False)
TINY_CONFIG = dict(CONFIG, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=1000)
"""The same family and code paths with tensors of at most 0.3 MB: a conversion's peak RSS is its floor."""
PATHS = {  # name: (source: the ZeRO checkpoint or an earlier path's output, convert arguments)
    "zero_to_hf": ("zero", ["--to", "hf"]),  # the torch-free route
    "zero_to_hf_bf16": ("zero", ["--to", "hf", "--dtype", "bf16"]),  # the torch reader and HF writer
    "zero_to_megatron": ("zero", ["--to", "megatron", "--tp", "2", "--pp", "2"]),
    "zero_to_megatron_weights_only": ("zero", ["--to", "megatron", "--tp", "2", "--pp", "2", "--weights-only"]),
    "zero_to_zero_universal": ("zero", ["--to", "zero", "--dp", "2", "--zero-stage", "3"]),
    "megatron_to_hf": ("zero_to_megatron", ["--to", "hf"]),
    "megatron_to_zero": ("zero_to_megatron", ["--to", "zero", "--dp", "2", "--zero-stage", "3"]),
    "hf_to_megatron": ("zero_to_hf", ["--to", "megatron", "--tp", "2"]),
    "zero_to_dcp": ("zero", ["--to", "dcp"]),  # PyTorch DCP (FSDP2), written by DCP's own writer
    "dcp_to_hf": ("zero_to_dcp", ["--to", "hf"]),
    "dcp_to_megatron": ("zero_to_dcp", ["--to", "megatron", "--tp", "2"]),
}


def _rank(rank: int, world: int, port: int, ckpt: str, model: dict) -> None:
    import deepspeed
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    kw = dict(model)
    config = AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "train_batch_size": world,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "zero_optimization": {"stage": 3},
          "steps_per_print": 10 ** 9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    ids = torch.randint(0, config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(rank))
    engine.backward(engine(input_ids=ids, labels=ids).loss)
    engine.step()
    engine.save_checkpoint(ckpt, tag="global_step1")
    if rank == 0:  # as HF Trainer leaves it: config.json beside global_stepN/
        config.to_json_file(os.path.join(ckpt, "config.json"))
    dist.barrier()
    dist.destroy_process_group()


def build(ckpt: Path, tiny: bool = False) -> None:
    """The checkpoint, built in a child process so that this one stays small: a child's ru_maxrss
    counts the RSS of the process it was forked from (fork copies the page tables before exec), so
    a parent that had imported torch (~220 MB) would set a floor under every measured peak."""
    if not (ckpt / "latest").is_file():
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--build-only", str(ckpt)]
                       + (["--tiny"] if tiny else []), cwd=REPO, check=True)


def _build_here(ckpt: Path, model: dict) -> None:
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    print(f"building the ZeRO-3 DP=2 checkpoint in {ckpt} (DeepSpeed, CPU) ...", flush=True)
    mp.start_processes(_rank, args=(2, port, str(ckpt), model), nprocs=2, start_method="spawn", join=True)


def measure(cmd: list[str], out: Path) -> dict:
    """Wall time and peak RSS of one child process (its own ru_maxrss, from wait4)."""
    if out.exists():
        shutil.rmtree(out)
    tic = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    stderr_tail = b""
    while True:  # read stderr so a chatty child never blocks; wait4 gives this child's own rusage
        chunk = proc.stderr.read(65536)
        if not chunk:
            break
        stderr_tail = (stderr_tail + chunk)[-4000:]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    wall = time.perf_counter() - tic
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}:\n{stderr_tail.decode(errors='replace')}")
    return {"wall_s": round(wall, 3), "peak_rss_mb": round(usage.ru_maxrss / 1024, 1)}


def check_equal(ours: Path, ref: Path) -> int:
    """Tensors of our HF output vs zero_to_fp32's: names and values identical."""
    import torch
    from safetensors import safe_open
    ref_files = sorted(ref.glob("*.safetensors"))
    ref_where = {k: f for f in ref_files for k in safe_open(str(f), "pt").keys()}
    ours_where = {k: f for f in sorted(ours.glob("*.safetensors")) for k in safe_open(str(f), "pt").keys()}
    assert set(ref_where) == set(ours_where), sorted(set(ref_where) ^ set(ours_where))[:5]
    for k in ref_where:
        a = safe_open(str(ours_where[k]), "pt").get_tensor(k)
        b = safe_open(str(ref_where[k]), "pt").get_tensor(k)
        assert torch.equal(a, b.to(a.dtype)), k
    return len(ref_where)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default="/tmp/toolkit_bench_convert")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sections", default="timing,memory", help="timing (vs zero_to_fp32), memory (every path)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "convert.json"))
    ap.add_argument("--build-only", metavar="CKPT", help=argparse.SUPPRESS)  # build() runs this in a child
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.build_only:
        _build_here(Path(args.build_only), TINY_CONFIG if args.tiny else CONFIG)
        return 0
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    ckpt = work / "checkpoint-1"
    build(ckpt)
    sections = set(args.sections.split(","))
    out = Path(args.out)
    record = json.loads(out.read_text()) if out.is_file() else {}  # a section not run keeps its last figures
    record["benchmark"] = "convert"
    if "memory" in sections:  # first: timing's output check imports torch here, and a child's peak counts ours
        record["memory"] = {"machine": _machine(), **memory(work, ckpt)}
    if "timing" in sections:
        machine = _machine()
        record.update(when=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), machine=machine,
                      **timing(work, ckpt, args.repeats))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2))
    print(f"written {out}")
    return 0


def _machine() -> dict:
    from importlib.metadata import version  # not ``import torch``: this process must stay small (build())
    return {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "torch": version("torch"), "load_average": os.getloadavg()}


def timing(work: Path, ckpt: Path, repeats: int) -> dict:
    """Ours vs zero_to_fp32 and a plain copy: wall time and peak RSS, best of ``repeats``."""
    size = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    py = sys.executable
    cases = {
        "zero_to_fp32": [py, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(work / "out_zero_to_fp32"),
                         "--safe_serialization"],
        "ours_zero_to_hf": [py, "-m", "toolkit", "convert", str(ckpt), str(work / "out_ours_zero_to_hf"), "--to", "hf"],
        "ours_zero_to_megatron_tp2_pp2": [py, "-m", "toolkit", "convert", str(ckpt),
                                          str(work / "out_ours_zero_to_megatron_tp2_pp2"), "--to", "megatron",
                                          "--tp", "2", "--pp", "2"],
        "ours_zero_to_megatron_tp2_pp2_weights_only": [py, "-m", "toolkit", "convert", str(ckpt),
                                                       str(work / "out_ours_zero_to_megatron_tp2_pp2_weights_only"),
                                                       "--to", "megatron", "--tp", "2", "--pp", "2", "--weights-only"],
        "copy": ["cp", "-r", str(ckpt), str(work / "out_copy")],
    }
    import resource
    parent_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # every child's peak includes it
    runs = {name: [] for name in cases}
    for _ in range(repeats):  # interleaved, so a busy moment on the shared machine hits all alike
        for name, cmd in cases.items():
            runs[name].append(measure(cmd, work / f"out_{name}"))
    results = {name: {"wall_s": min(r["wall_s"] for r in rs), "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
                      "runs": rs} for name, rs in runs.items()}
    tensors = check_equal(work / "out_ours_zero_to_hf", work / "out_zero_to_fp32")
    ref = results["zero_to_fp32"]
    for name, r in results.items():
        r["wall_vs_zero_to_fp32"] = round(r["wall_s"] / ref["wall_s"], 3)
        r["rss_vs_zero_to_fp32"] = round(r["peak_rss_mb"] / ref["peak_rss_mb"], 3)
    print(f"checkpoint: {size / 1e9:.2f} GB on disk (ZeRO-3, DP=2, {tensors} tensors)")
    print(f"{'case':<44}{'wall s':>9}{'x z2fp32':>10}{'peak RSS MB':>13}{'x z2fp32':>10}")
    for name, r in results.items():
        print(f"{name:<44}{r['wall_s']:>9.2f}{r['wall_vs_zero_to_fp32']:>10.2f}{r['peak_rss_mb']:>13.0f}"
              f"{r['rss_vs_zero_to_fp32']:>10.2f}")
    targets = {"rss_le_quarter": results["ours_zero_to_hf"]["rss_vs_zero_to_fp32"] <= 0.25,
               "wall_le_half": results["ours_zero_to_hf"]["wall_vs_zero_to_fp32"] <= 0.5}
    print(f"targets (ours ZeRO->HF): RSS <= 1/4: {targets['rss_le_quarter']}, wall <= 1/2: {targets['wall_le_half']}")
    return {"checkpoint": {"model": CONFIG, "zero_stage": 3, "dp": 2, "bytes": size}, "parent_rss_mb": round(parent_rss, 1),
            "hf_output_equals_zero_to_fp32": True, "tensors_compared": tensors, "repeats": repeats,
            "results": results, "targets": targets}


def largest_tensor_bytes(model: dict) -> int:
    """fp32 bytes of the model's largest tensor (Llama: the embedding or the fused MLP input)."""
    h, i, v = model["hidden_size"], model["intermediate_size"], model["vocab_size"]
    return 4 * max(v * h, 2 * i * h)


def memory(work: Path, ckpt: Path) -> dict:
    """Peak RSS of every conversion path on the 134M model and on the tiny one (its floor)."""
    tiny = work / "checkpoint-tiny"
    build(tiny, tiny=True)
    peaks = {}
    for size, src in (("tiny", tiny), ("model", ckpt)):
        outs = {"zero": src}
        for name, (source, extra) in PATHS.items():
            outs[name] = work / f"mem_{size}_{name}"
            cmd = [sys.executable, "-m", "toolkit", "convert", str(outs[source]), str(outs[name]), *extra]
            peaks[(size, name)] = measure(cmd, outs[name])
    largest = largest_tensor_bytes(CONFIG) / 2**20
    rows = {}
    print(f"{'path':<32}{'floor MB':>10}{'peak MB':>10}{'above floor':>13}{'x largest':>11}{'wall s':>9}")
    for name in PATHS:
        floor, peak = peaks[("tiny", name)]["peak_rss_mb"], peaks[("model", name)]["peak_rss_mb"]
        rows[name] = {"floor_mb": floor, "peak_mb": peak, "above_floor_mb": round(peak - floor, 1),
                      "above_floor_in_largest_tensors": round((peak - floor) / largest, 2),
                      "wall_s": peaks[("model", name)]["wall_s"], "args": PATHS[name][1], "source": PATHS[name][0]}
        r = rows[name]
        print(f"{name:<32}{floor:>10.0f}{peak:>10.0f}{r['above_floor_mb']:>13.0f}"
              f"{r['above_floor_in_largest_tensors']:>11.2f}{r['wall_s']:>9.1f}")
    print(f"largest tensor: {largest:.1f} MB (fp32 embedding [{CONFIG['vocab_size']}, {CONFIG['hidden_size']}])")
    return {"when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average": os.getloadavg(),
            "model": CONFIG, "tiny_model": TINY_CONFIG, "largest_tensor_mb": round(largest, 1), "paths": rows}


if __name__ == "__main__":
    sys.exit(main())

"""Peak host memory per rank while a model loads and while it is exported, as the layout shards it.

    python benchmarks/big_models.py                       # 0.1B, 0.5B, 1.5B Llama; ~40 min on 2 cores
    python benchmarks/big_models.py --sizes tiny,0.1 --cases zero3,tp2

Each case starts 2 ranks (gloo, spawned), builds the engine from a pretrained safetensors checkpoint
(model.init=pretrained, fp32) as ``toolkit train`` does until the rank is ready for step 1, then
writes ``hf_final`` as the trainer's export does. Per rank it reads the kernel's high-water mark of
resident memory (VmHWM, reset through /proc/self/clear_refs before each phase) and reports the peak
above the rank's floor (RSS after imports and the process group, before the model). Cases:

  zero3     toolkit ZeRO-3, DP=2       zero2   toolkit ZeRO-2, DP=2
  tp2       toolkit megatron TP=2      pp2     toolkit megatron PP=2
  hf_zero3  transformers as HF Trainer loads under DeepSpeed ZeRO-3 (``HfDeepSpeedConfig``, so
            ``from_pretrained`` builds under ``zero.Init``), then ``deepspeed.initialize``; export as
            Trainer saves a ZeRO-3 model (16-bit weights gathered to rank 0, ``save_pretrained``)

No optimizer step is taken (a 1.5B model's Adam moments would not fit 2 ranks in 24 GiB); the model
states DeepSpeed and megatron allocate at initialization (fp32 master partitions, gradient
buffers) are part of "load". Results: benchmarks/results/big_models.json; ``--table`` prints the
markdown table of docs/benchmarks.md from it, with the bounds ``toolkit estimate`` predicts (its
``host_load``/``host_export`` and the model states; the runtime is the tiny model's figure, same case).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 32000, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False, "max_position_embeddings": 2048,
         "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
SIZES = {  # ~parameters: hidden, layers, heads, kv heads, MLP width
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 intermediate_size=128, vocab_size=2048),
    "0.1": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                intermediate_size=2048),
    "0.5": dict(hidden_size=1280, num_hidden_layers=20, num_attention_heads=20, num_key_value_heads=4,
                intermediate_size=3456),
    "1.5": dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=8,
                intermediate_size=5632),
}
CASES = ("zero3", "zero2", "tp2", "pp2", "hf_zero3")
OVERRIDES = {"zero3": {"zero": {"stage": 3}}, "zero2": {"zero": {"stage": 2}},
             "tp2": {"backend": "megatron", "megatron": {"tp": 2}}, "pp2": {"backend": "megatron", "megatron": {"pp": 2}},
             "hf_zero3": {"zero": {"stage": 3}}}


def memory_mb() -> dict:
    status = Path("/proc/self/status").read_text().splitlines()
    kb = {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "VmHWM"))}
    return {"rss": kb["VmRSS"] / 1024, "hwm": kb["VmHWM"] / 1024}


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS


def checkpoint(size: str, root: Path) -> Path:
    """A pretrained checkpoint of that size (seeded weights, saved once, reused)."""
    out = root / f"llama-{size}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, LlamaConfig
    config = LlamaConfig(**{k: v for k, v in {**LLAMA, **SIZES[size]}.items() if k not in ("model_type", "architectures")})
    model = AutoModelForCausalLM.from_config(config)
    tmp = root / f".llama-{size}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    os.replace(tmp, out)
    return out


def run_config(case: str, model_dir: Path, run_dir: Path, dtype: str):
    from toolkit.config import validate
    raw = {"model": {"name_or_path": str(model_dir), "init": "pretrained", "dtype": dtype}, "run_dir": str(run_dir),
           "train": {"global_batch_size": 2, "micro_batch_size": 1}, "data": {"seq_len": 32}}
    for section, values in OVERRIDES[case].items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    return validate(raw)


def toolkit_rank(case: str, model_dir: Path, out: Path, dtype: str) -> dict:
    import torch.distributed as dist

    from toolkit.plan import build_plan
    plan = build_plan(run_config(case, model_dir, out, dtype), [dist.get_world_size()])
    floor = memory_mb()["rss"]
    reset_peak()
    built = {}
    if plan.config.backend == "megatron":
        from toolkit.adapters.megatron import build_engine
        from toolkit.adapters.megatron import engine as megatron_engine
        wrap = megatron_engine.MegatronEngine._wrap_ddp

        def built_then_wrap(self, chunks):  # the model's layers built and loaded; DDP's buffers not yet
            built["build_peak_mb"] = memory_mb()["hwm"] - floor
            return wrap(self, chunks)
        megatron_engine.MegatronEngine._wrap_ddp = built_then_wrap
        engine = build_engine(plan, out, dist.get_rank())
    else:  # the HF model first (its construction alone), then DeepSpeed's engine around it
        from toolkit.adapters.deepspeed import DeepSpeedEngine, build_model
        model = build_model(plan, plan.ds_config(dist.get_world_size()))
        built = {"build_peak_mb": memory_mb()["hwm"] - floor}
        engine = DeepSpeedEngine(plan, model)
    load = memory_mb()
    reset_peak()
    engine.export_hf(out / "hf_final", tokenizer=None)
    export = memory_mb()
    return {"floor_mb": floor, **built, "load_peak_mb": load["hwm"] - floor, "after_load_mb": load["rss"] - floor,
            "export_peak_mb": export["hwm"] - floor}


def hf_rank(model_dir: Path, out: Path, dtype: str) -> dict:
    import deepspeed
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.integrations import HfDeepSpeedConfig

    from toolkit.plan import build_plan
    plan = build_plan(run_config("hf_zero3", model_dir, out, dtype), [dist.get_world_size()])
    ds_config = plan.ds_config(dist.get_world_size())
    ds_config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
    deepspeed.init_distributed(dist_backend="gloo")
    floor = memory_mb()["rss"]
    reset_peak()
    keep = HfDeepSpeedConfig(ds_config)  # noqa: F841 (while alive, from_pretrained builds under zero.Init)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    built = {"build_peak_mb": memory_mb()["hwm"] - floor}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    load = memory_mb()
    reset_peak()
    state = engine._zero3_consolidated_16bit_state_dict()  # what Trainer.save_model does at ZeRO-3
    if dist.get_rank() == 0:
        engine.module.save_pretrained(str(out / "hf_final"), state_dict=state, safe_serialization=True)
    dist.barrier()
    export = memory_mb()
    return {"floor_mb": floor, **built, "load_peak_mb": load["hwm"] - floor, "after_load_mb": load["rss"] - floor,
            "export_peak_mb": export["hwm"] - floor}


def rank_main(rank: int, world: int, port: int, case: str, model_dir: str, out: str, dtype: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    from toolkit.parallel import init_process_group
    init_process_group()
    work = Path(out) / f"rank{rank}"
    result = hf_rank(Path(model_dir), Path(out), dtype) if case == "hf_zero3" else \
        toolkit_rank(case, Path(model_dir), Path(out), dtype)
    work.mkdir(parents=True, exist_ok=True)
    (work / "result.json").write_text(json.dumps(result))


def measure(case: str, model_dir: Path, dtype: str) -> list[dict]:
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=model_dir.parent) as out:
        mp.start_processes(rank_main, args=(2, port, case, str(model_dir), out, dtype), nprocs=2, start_method="spawn")
        return [json.loads((Path(out) / f"rank{r}" / "result.json").read_text()) for r in range(2)]


def model_facts(model_dir: Path) -> dict:
    from safetensors import safe_open
    sizes = {}
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                shape = h.get_slice(k).get_shape()
                n = 1
                for d in shape:
                    n *= d
                sizes[k] = n * 4
    return {"params": sum(sizes.values()) // 4, "model_mb": sum(sizes.values()) / 2**20,
            "largest_tensor_mb": max(sizes.values()) / 2**20}


def estimated_mb(key: str, result: dict, root: Path) -> dict:
    """``toolkit estimate``'s per-rank figures for this case (MB): host memory at load and export, and
    the model states plus buffers the engine allocates (on CPU these live in the same RSS)."""
    from toolkit.estimate.memory import memory
    from toolkit.plan import build_plan
    size, case = key.split("/")
    plan = build_plan(run_config(case, checkpoint(size, root), root / "unused", result["dtype"]), [2])
    ds = plan.ds_config(2).get("zero_optimization", {}) if plan.config.backend == "deepspeed" else {}
    mem = memory(plan.config, plan.model, plan.layout(2), int(ds.get("reduce_bucket_size", 0)) or None)
    return {"host_load": mem.host_load / 2**20, "host_export": mem.host_export / 2**20,
            "states": (mem.model_state + mem.buffers) / 2**20}


def table(results: dict, root: Path) -> str:
    """Markdown: per case the worst rank's peaks (MB above its floor) beside their bounds. Build bound:
    estimate's host_load + the tiny model's build peak (runtime), and by how much the build exceeds it
    in largest tensors of the training dtype (the CPU-only transient ``estimate/memory.py`` describes);
    engine-ready: host_load + model states + buffers + the tiny model's engine-ready peak; export
    transient: export peak - RSS after load (estimate: (w+4)·Λ)."""
    rows = ["| params | case | dtype | model MB | build peak | bound | over, in w·Λ | engine ready | bound | export transient |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        if key.startswith("tiny/"):
            continue
        case, runtime = key.split("/")[1], results.get(f"tiny/{key.split('/')[1]}")
        worst = {k: max(rank[k] for rank in r["ranks"]) for k in ("build_peak_mb", "load_peak_mb")}
        transient = max(rank["export_peak_mb"] - rank["after_load_mb"] for rank in r["ranks"])
        tiny = {k: max(rank[k] for rank in runtime["ranks"]) for k in worst} if runtime else dict.fromkeys(worst, 0)
        if case == "hf_zero3":  # not the toolkit's plan: no bound of ours applies
            bounds = ("", "", "")
        else:
            est = estimated_mb(key, r, root)
            build_bound = est["host_load"] + tiny["build_peak_mb"]
            tensor_mb = r["largest_tensor_mb"] * (2 if r["dtype"] == "bf16" else 4) / 4  # largest_tensor_mb is fp32
            over = max(0.0, worst["build_peak_mb"] - build_bound) / tensor_mb
            bounds = (f"{build_bound:.0f}", f"{over:.2f}",
                      f"{est['host_load'] + est['states'] + tiny['load_peak_mb']:.0f}")
        rows.append(f"| {r['params'] / 1e9:.2f}B | {case} | {r['dtype']} | {r['model_mb']:.0f} | "
                    f"{worst['build_peak_mb']:.0f} | {bounds[0]} | {bounds[1]} | {worst['load_peak_mb']:.0f} | "
                    f"{bounds[2]} | {transient:+.0f} |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="tiny,0.1,0.5,1.5")
    p.add_argument("--cases", default=",".join(CASES))
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                   help="training dtype (the checkpoints are fp32); bf16 lets 1.5B's ZeRO-2 fit 2 ranks in 24 GiB")
    p.add_argument("--root", type=Path, default=Path(tempfile.gettempdir()) / "toolkit-big-models")
    p.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "big_models.json")
    p.add_argument("--table", action="store_true", help="print the table from --out and stop (runs nothing)")
    args = p.parse_args()
    if args.table:
        print(table(json.loads(args.out.read_text()), args.root))
        return 0
    args.root.mkdir(parents=True, exist_ok=True)
    results = json.loads(args.out.read_text()) if args.out.is_file() else {}
    for size in args.sizes.split(","):
        model_dir = checkpoint(size, args.root)
        facts = model_facts(model_dir)
        for case in args.cases.split(","):
            tic = time.perf_counter()
            ranks = measure(case, model_dir, args.dtype)
            results[f"{size}/{case}"] = {**facts, "dtype": args.dtype, "ranks": ranks,
                                         "seconds": round(time.perf_counter() - tic, 1)}
            args.out.write_text(json.dumps(results, indent=2))
            worst = {k: max(r[k] for r in ranks) for k in ("load_peak_mb", "export_peak_mb")}
            print(f"{size:>4}B {case:9s} model {facts['model_mb']:8.0f} MB  load +{worst['load_peak_mb']:8.0f} MB "
                  f"({worst['load_peak_mb'] / facts['model_mb']:.2f}x model)  export +{worst['export_peak_mb']:8.0f} MB "
                  f"({worst['export_peak_mb'] / facts['model_mb']:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

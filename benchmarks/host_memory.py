"""Host memory of one training step per rank at long sequences, with glibc's mmap threshold fixed
(``toolkit/heap.py``, what every rank does) and left dynamic, DP2 against ``zero.sp=2`` (DeepSpeed)
and megatron's DP2 against ``megatron.cp=2``; beside each RSS figure, the bytes autograd saved.

    python benchmarks/host_memory.py                                   # the grid below (~40 min on 2 cores)
    python benchmarks/host_memory.py --seqs 16384 --modes dp2,sp2 --stages 2 --heap on --repeat 3
    python benchmarks/host_memory.py --seqs 8192 --modes dp2 --stages 2 --heap on --packing documents

Model: a Llama of hidden 512, 4 layers, 8 heads of 64, 4 KV heads, intermediate 1536, vocabulary
2048, fp32, random weights; one row of ``seq`` tokens per rank per step (dp2: each rank its own row;
sp2 and cp2: both ranks share one row). DeepSpeed at ZeRO-2 (``--stages 2``) and at ZeRO-3 with the
optimizer and parameters offloaded to the CPU (``--stages 3``); megatron with its distributed
optimizer. Plain rows run sdpa's causal kernel; ``--packing documents`` packs documents of 512-2,048
tokens and runs the document mask.

Per rank, after a warm-up step and glibc's malloc_trim (the warm-up's freed heap goes back, so both
settings start alike): ``growth``, the step's high-water mark of resident memory (VmHWM, reset
through /proc/self/clear_refs) above the RSS just before it; ``held``, RSS after the step above the
RSS before (free heap the step left resident, and optimizer state's growth); ``saved``, the bytes of
distinct storages autograd saved for backward (saved-tensor hooks; weights left out), which is what
the activations should cost; ``step_s``; ``page_faults``, the step's minor faults (fresh pages the
kernel zeroed: what mapping and unmapping large blocks costs). Each case runs in fresh ranks; with ``--repeat`` the settings
alternate within each round (on, off, on, off), so load drift on a shared machine falls on both. The table shows the fuller
rank; ``vs dp2``: growth over that of DP2 (same backend, stage, setting and sequence) in the run.
Results: benchmarks/results/host_memory.json (``--out``), with the machine's load average.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RESULT = REPO / "benchmarks" / "results" / "host_memory.json"

MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 1536, "vocab_size": 2048,
         "max_position_embeddings": 65536, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu",
         "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
MODES = {"dp2": ("deepspeed", 1), "sp2": ("deepspeed", 2), "mdp2": ("megatron", 1), "cp2": ("megatron", 2)}
"""mode -> (backend, ranks sharing a row): zero.sp or megatron.cp."""


def _status_mib() -> dict:
    kb = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            kb[line.split(":")[0]] = int(line.split()[1])
    return {"rss": kb["VmRSS"] / 1024, "hwm": kb["VmHWM"] / 1024}


def _micro_batch(seq: int, row: int, packing: str):
    import torch
    g = torch.Generator().manual_seed(1000 + row)
    ids = torch.randint(1, MODEL["vocab_size"], (1, seq), generator=g)
    mb = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    if packing == "documents":
        lengths = []
        while sum(lengths) < seq:
            lengths.append(int(torch.randint(512, 2049, (1,), generator=g)))
        lengths[-1] -= sum(lengths) - seq
        mb["document_ids"] = torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths))[None]
    return mb


def _config(case: dict, model_dir: str, world: int) -> dict:
    backend, split = MODES[case["mode"]]
    rows = world // split
    cfg = {"backend": backend, "model": {"name_or_path": model_dir},
           "data": {"seq_len": case["seq"], "packing": case["packing"]},
           "train": {"global_batch_size": rows, "micro_batch_size": 1, "lr": 1e-4}}
    if backend == "megatron":
        cfg["megatron"] = {"cp": split}
    else:
        offload = case["stage"] == 3
        cfg["zero"] = {"stage": case["stage"], "sp": split, "offload_optimizer": offload, "offload_params": offload}
    return cfg


def _engine(case: dict, model_dir: str, world: int):
    from toolkit.config import validate
    from toolkit.plan import build_plan
    plan = build_plan(validate(_config(case, model_dir, world)), [world])
    if MODES[case["mode"]][0] == "megatron":
        from transformers import AutoConfig, AutoModelForCausalLM

        from toolkit.adapters.megatron import MegatronEngine
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))  # random weights
        return MegatronEngine(plan, model.state_dict())
    from toolkit.adapters.deepspeed import DeepSpeedEngine, build_model
    return DeepSpeedEngine(plan, build_model(plan, plan.ds_config(world)))


def _saved_bytes(step):
    """Run ``step()`` counting the distinct storages autograd saves (parameters left out)."""
    import torch
    saved: dict[int, int] = {}

    def pack(t):
        base = t._base if t._base is not None else t
        if not isinstance(base, torch.nn.Parameter):
            storage = t.untyped_storage()
            saved[storage.data_ptr()] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        stats = step()
    return stats, sum(saved.values())


def _rank(rank: int, world: int, model_dir: str, case: dict) -> dict:
    import ctypes
    import resource

    import torch

    threshold = None
    if case["heap"] == "on":  # as a rank does (toolkit/heap.py); imported only then: a checkout without it runs "off"
        from toolkit import heap
        threshold = heap.return_large_frees({})
    torch.set_num_threads(1)  # one core per rank, as the launcher's OMP_NUM_THREADS=1
    engine = _engine(case, model_dir, world)
    split = MODES[case["mode"]][1]
    mb = _micro_batch(case["seq"], rank // split, case["packing"])
    tokens = case["seq"] * world // split
    engine.train_step([mb], tokens, 1e-4)  # warm-up: optimizer state, one-time buffers
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _status_mib()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tic = time.perf_counter()
    stats, saved = _saved_bytes(lambda: engine.train_step([mb], tokens, 1e-4))
    seconds = time.perf_counter() - tic
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    after = _status_mib()
    return {"rank": rank, "growth_mib": after["hwm"] - before["rss"], "held_mib": after["rss"] - before["rss"],
            "rss_before_mib": before["rss"], "saved_mib": saved / 2**20, "step_s": seconds, "loss": stats.loss,
            "page_faults": faults, "mmap_threshold": threshold}


def measure(case: dict, model_dir: str, tmp: Path) -> dict:
    from tests.helpers.ranks import run_ranks
    out = Path(tempfile.mkdtemp(dir=tmp))
    load = os.getloadavg()[0]
    ranks = run_ranks(_rank, 2, out, model_dir, case, timeout=3600)
    fuller = max(ranks, key=lambda r: r["growth_mib"])
    return {**case, "ranks": ranks, "growth_mib": fuller["growth_mib"], "held_mib": fuller["held_mib"],
            "saved_mib": fuller["saved_mib"], "step_s": max(r["step_s"] for r in ranks),
            "page_faults": max(r.get("page_faults", 0) for r in ranks),
            "loss": ranks[0]["loss"], "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2)}


def _ratios(rows: list[dict]) -> None:
    """``vs_dp2``: growth over the same run's DP2 of the same backend, stage, setting and sequence."""
    for r in rows:
        base_mode = "dp2" if MODES[r["mode"]][0] == "deepspeed" else "mdp2"
        key = (base_mode, r["seq"], r["stage"], r["heap"], r["packing"], r["run"])
        base = next((b for b in rows if (b["mode"], b["seq"], b["stage"], b["heap"], b["packing"], b["run"]) == key),
                    None)
        r["vs_dp2"] = round(r["growth_mib"] / base["growth_mib"], 3) if base else None


def table(rows: list[dict]) -> str:
    lines = ["| seq | mode | stage | heap | run | growth MiB | held MiB | saved MiB | vs dp2 | step s | page faults | loss |",
             "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        stage = "megatron" if MODES[r["mode"]][0] == "megatron" else f"zero-{r['stage']}"
        lines.append(f"| {r['seq']} | {r['mode']} | {stage} | {r['heap']} | {r['run']} | {r['growth_mib']:.0f} | "
                     f"{r['held_mib']:.0f} | {r['saved_mib']:.0f} | {r['vs_dp2'] if r['vs_dp2'] else '-'} | "
                     f"{r['step_s']:.1f} | {r.get('page_faults', 0):,} | {r['loss']!r} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", default="4096,8192,16384")
    parser.add_argument("--modes", default="dp2,sp2")
    parser.add_argument("--stages", default="2,3", help="DeepSpeed: 2 (ZeRO-2), 3 (ZeRO-3, optimizer and "
                        "parameters offloaded to the CPU); megatron modes run once per sequence")
    parser.add_argument("--heap", default="on,off", help="on: the rank fixes glibc's mmap threshold; off: dynamic")
    parser.add_argument("--packing", default="concat", choices=["concat", "documents"])
    parser.add_argument("--repeat", type=int, default=1, help="runs of each case (consecutive)")
    parser.add_argument("--thp", action="store_true", help="THP_MEM_ALLOC_ENABLE=1 in every rank (torch's tensors "
                        "of 2 MiB and more on transparent huge pages: fewer page faults per mapped block)")
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    if args.thp:  # read once by torch's allocator: set before the ranks' forkserver imports torch
        os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    cases = []
    for seq in [int(s) for s in args.seqs.split(",")]:
        for stage in [int(s) for s in args.stages.split(",")]:
            for run in range(args.repeat):  # the settings alternate within a run: on, off, on, off (load drift)
                for heap in args.heap.split(","):
                    for mode in args.modes.split(","):
                        if MODES[mode][0] == "megatron" and stage != int(args.stages.split(",")[0]):
                            continue
                        cases.append({"mode": mode, "seq": seq, "stage": stage, "heap": heap,
                                      "packing": args.packing, "run": run})
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(MODEL))
        for case in cases:
            rows.append(measure(case, str(model_dir), Path(tmp)))
            r = rows[-1]
            print(f"seq {r['seq']} {r['mode']} stage {r['stage']} heap {r['heap']} run {r['run']}: growth "
                  f"{r['growth_mib']:.0f} MiB, held {r['held_mib']:.0f}, saved {r['saved_mib']:.0f}, step "
                  f"{r['step_s']:.1f} s, {r['page_faults']:,} page faults, loss {r['loss']!r} "
                  f"(load {r['load_before']})", flush=True)
    _ratios(rows)
    result = {"benchmark": "host_memory", "model": MODEL, "dtype": "fp32", "device": "cpu (gloo)", "thp": args.thp,
              "machine": platform.machine(), "cores": os.cpu_count(), "python": sys.version.split()[0],
              "argv": sys.argv[1:] if argv is None else argv, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

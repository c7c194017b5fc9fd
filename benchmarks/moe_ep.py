"""Mixture of experts on 2 CPU ranks (gloo): step time and the bytes each rank sends, per way of training
the experts, with ``toolkit estimate``'s prediction beside each (issue #45).

Model: a Mixtral of 8 experts (top-2), hidden 128, expert width 256, 2 layers, vocabulary 2048; fp32; rows of
128 tokens, 8 rows per step, micro-batches of 2 (2 per rank). Cases, each the toolkit's engine driven by
``train_step`` on the same seeded batches:

  zero3               DeepSpeed ZeRO-3 (``zero.Init``), experts gathered like every other weight
  megatron_ep2        megatron-core EP=2 (dense parameters DP=2), the toolkit's grouped experts
                      (``model.experts_implementation=grouped_mm``)
  megatron_ep2_eager  the same with megatron's SequentialMLP (``eager``)
  zero_ep2            DeepSpeed ZeRO-2 with ``zero.ep=2`` (DeepSpeed's AutoEP: each rank 4 of the 8 experts,
                      tokens exchanged by all-to-all)

Bytes sent: every ``torch.distributed`` collective wrapped in each rank before anything captures the
functions (DeepSpeed's comm backend and megatron's mappings keep references), counted as a ring sends
them: (p-1)/p of an all-gather's output, of a reduce-scatter's or all-to-all's input, twice that of an
all-reduce. The estimate's prediction: the same sum over the collectives ``estimate/steptime.py`` lists
for the step (model and experts; not the trainer's few scalars), and its step time on a "cluster" of
this machine: one core's fp32 matmul rate (mfu 1) and gloo's measured latency and bandwidth between the
two ranks. Step time: rank 0's interval between consecutive ``train_step`` returns after a barrier,
median over ``--steps`` after ``--warmup``.

    python benchmarks/moe_ep.py                 # ~2 min on 2 cores
Writes benchmarks/results/moe_ep.json (or --out) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "moe_ep.json"
MODEL = dict(model_type="mixtral", architectures=["MixtralForCausalLM"], hidden_size=128, intermediate_size=256,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=2048,
             max_position_embeddings=256, num_local_experts=8, num_experts_per_tok=2, router_aux_loss_coef=0.02,
             tie_word_embeddings=False, pad_token_id=0)
SETS = ["data.seq_len=128", "train.global_batch_size=8", "train.micro_batch_size=2", "data.packing=concat"]
CASES = {
    "zero3": ["zero.stage=3"],
    "megatron_ep2": ["backend=megatron", "megatron.ep=2", "model.experts_implementation=grouped_mm"],
    "megatron_ep2_eager": ["backend=megatron", "megatron.ep=2", "model.experts_implementation=eager"],
    "zero_ep2": ["zero.stage=2", "zero.ep=2"],
}
DEFAULT_CASES = ["zero3", "megatron_ep2", "megatron_ep2_eager", "zero_ep2"]
WORLD = 2


# --- in each rank -----------------------------------------------------------------------------------

def _count_collectives(sent: dict) -> None:
    """Wrap torch.distributed's collectives to add the bytes this rank sends to ``sent[name]``."""
    import inspect

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    def nbytes(t) -> int:
        return t.numel() * t.element_size()

    def share(a) -> float:  # (p-1)/p of the group
        p = dist.get_world_size(a.get("group"))
        return (p - 1) / p

    rules = {  # name: bytes this rank sends, from the call's bound arguments
        "all_reduce": lambda a: 2 * share(a) * nbytes(a["tensor"]),
        "all_reduce_coalesced": lambda a: 2 * share(a) * sum(map(nbytes, a["tensors"])),
        "all_gather_into_tensor": lambda a: share(a) * nbytes(a["output_tensor"]),
        "_all_gather_base": lambda a: share(a) * nbytes(a["output_tensor"]),
        "all_gather": lambda a: share(a) * len(a["tensor_list"]) * nbytes(a["tensor"]),
        "reduce_scatter_tensor": lambda a: share(a) * nbytes(a["input"]),
        "_reduce_scatter_base": lambda a: share(a) * nbytes(a["input"]),
        "reduce_scatter": lambda a: share(a) * sum(map(nbytes, a["input_list"])),
        "all_to_all_single": lambda a: share(a) * nbytes(a["input"]),
        "broadcast": lambda a: nbytes(a["tensor"]) if dist.get_rank() == a["src"] else 0,
    }
    for name, rule in rules.items():
        original = getattr(c10d, name)
        signature = inspect.signature(original)

        def wrapped(*args, _original=original, _rule=rule, _name=name, _signature=signature, **kwargs):
            bound = _signature.bind(*args, **kwargs)
            bound.apply_defaults()
            sent[_name] = sent.get(_name, 0) + _rule(bound.arguments)
            return _original(*args, **kwargs)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)


def _rank_main(rank: int, case: str, port: int, workdir: str, steps: int, warmup: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    sent: dict = {}
    _count_collectives(sent)  # before DeepSpeed or megatron import and keep the functions
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    if case == "calibrate":
        result = _calibrate(rank)
    else:
        result = _train(case, Path(workdir), steps, warmup, sent)
    Path(workdir, f"{case}_rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def _train(case: str, workdir: Path, steps: int, warmup: int, sent: dict) -> dict:
    import torch
    import torch.distributed as dist

    from toolkit.config import load_config
    from toolkit.loss import IGNORE_INDEX
    from toolkit.plan import build_plan
    cfg = load_config(None, [*SETS, f"model.name_or_path={workdir / 'model'}", *CASES[case]])
    plan = build_plan(cfg, [WORLD])
    engine = _engine(plan)
    g = torch.Generator().manual_seed(3)
    rows, mbs, seq = cfg.train.global_batch_size, cfg.train.micro_batch_size, cfg.data.seq_len
    micro = [{"input_ids": torch.randint(0, MODEL["vocab_size"], (mbs, seq), generator=g),
              "labels": torch.randint(0, MODEL["vocab_size"], (mbs, seq), generator=g)} for _ in range(rows // mbs)]
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
    dp_rank, dp = getattr(engine, "dp_rank", dist.get_rank()), getattr(engine, "dp_size", WORLD)
    mine = micro[dp_rank::dp]
    times, losses = [], []
    for step in range(warmup + steps):
        dist.barrier()
        if step == warmup:
            sent.clear()
        start = time.perf_counter()
        losses.append(engine.train_step(mine, tokens, 1e-3).loss)
        times.append(time.perf_counter() - start)
    records = getattr(engine, "setup_records", [])
    return {"step_s": statistics.median(times[warmup:]), "sent_per_step": {k: v / steps for k, v in sent.items()},
            "losses": losses, "experts": [r for r in records if r.get("event") == "experts"]}


def _engine(plan):
    import torch.distributed as dist
    if plan.config.backend == "megatron":
        from toolkit.adapters.megatron import MegatronEngine
        return MegatronEngine(plan)
    from toolkit.adapters.deepspeed import DeepSpeedEngine, build_model
    return DeepSpeedEngine(plan, build_model(plan, plan.ds_config(dist.get_world_size())))


def _calibrate(rank: int) -> dict:
    """One core's fp32 matmul rate; gloo's latency (8-byte all-reduces) and bandwidth (32 MiB ones)."""
    import torch
    import torch.distributed as dist
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    tflops = 20 * 2 * 512**3 / (time.perf_counter() - start) / 1e12

    def timed(n: int, reps: int) -> float:
        t = torch.zeros(n)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            dist.all_reduce(t)
        return (time.perf_counter() - start) / reps
    small, big = timed(2, 200), timed(8 * 2**20, 5)
    latency = small / 2  # all-reduce over 2 ranks: 2(p-1) = 2 latencies
    gbps = 2 * (WORLD - 1) / WORLD * 32 * 2**20 / max(big - small, 1e-9) / 1e9
    return {"tflops": tflops, "latency_us": latency * 1e6, "gbps": gbps}


# --- the parent -------------------------------------------------------------------------------------

def run_ranks(case: str, workdir: Path, steps: int, warmup: int) -> list[dict]:
    import torch.multiprocessing as mp

    from toolkit.parallel import free_port
    mp.start_processes(_rank_main, args=(case, free_port(), str(workdir), steps, warmup), nprocs=WORLD,
                       join=True, start_method="spawn")
    return [json.loads((workdir / f"{case}_rank{r}.json").read_text()) for r in range(WORLD)]


def prediction(case: str, workdir: Path, machine: dict) -> dict:
    """The estimate of this case's step on this machine: bytes each rank sends (its collectives'
    ring shares), the experts' share of them, and the step time."""
    from toolkit.config import load_config
    from toolkit.estimate.run import expert_traffic
    from toolkit.estimate.steptime import Cluster, step_time
    from toolkit.plan import build_plan
    cfg = load_config(None, [*SETS, f"model.name_or_path={workdir / 'model'}", *CASES[case]])
    plan = build_plan(cfg, [WORLD])
    cluster = Cluster(nodes=1, gpus_per_node=WORLD, peak_tflops=machine["tflops"], mfu=1.0,
                      intra_gbps=machine["gbps"], intra_latency_us=machine["latency_us"])
    step = step_time(plan.config, plan.model, plan.layout(WORLD), cluster)
    sent = sum(c.count * c.nbytes * (c.ranks - 1) / c.ranks * (2 if c.kind == "all-reduce" else 1)
               for c in step.collectives)
    return {"sent_per_step": sent, "expert_sent_per_step": expert_traffic(step, plan.model), "step_s": step.total_s,
            "comm_s": step.comm_s, "compute_s": step.compute_s,
            "collectives": [f"{c.kind} ({c.group}, {c.ranks}) x{c.count}: {c.nbytes:,.0f} B" for c in step.collectives]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cases", nargs="+", default=DEFAULT_CASES, choices=sorted(CASES))
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        (workdir / "model").mkdir()
        (workdir / "model" / "config.json").write_text(json.dumps(MODEL))
        machine = run_ranks("calibrate", workdir, 0, 0)[0]
        results = {}
        for case in args.cases:
            ranks = run_ranks(case, workdir, args.steps, args.warmup)
            measured = {"step_s": ranks[0]["step_s"],
                        "sent_per_step": max(sum(r["sent_per_step"].values()) for r in ranks),
                        "sent_by_collective": ranks[0]["sent_per_step"], "losses": ranks[0]["losses"],
                        "experts": ranks[0]["experts"]}
            results[case] = {"measured": measured, "estimated": prediction(case, workdir, machine)}
    out = {"benchmark": "moe_ep", "model": MODEL, "sets": SETS, "world": WORLD, "steps": args.steps,
           "warmup": args.warmup, "machine": {**machine, "python": platform.python_version(),
                                               "processor": platform.processor(), "cpus": os.cpu_count()},
           "cases": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    _print(out)
    return 0


def _print(out: dict) -> None:
    m = out["machine"]
    print(f"machine: {m['tflops'] * 1e3:.1f} GFLOP/s per core (fp32 matmul), gloo {m['latency_us']:.0f} us, "
          f"{m['gbps']:.2f} GB/s")
    print(f"{'case':20s} {'step s':>8s} {'est. step s':>11s} {'sent MiB/step':>14s} {'est. MiB':>9s} "
          f"{'est. experts MiB':>16s}")
    for case, r in out["cases"].items():
        me, es = r["measured"], r["estimated"]
        print(f"{case:20s} {me['step_s']:8.3f} {es['step_s']:11.3f} {me['sent_per_step'] / 2**20:14.2f} "
              f"{es['sent_per_step'] / 2**20:9.2f} {es['expert_sent_per_step'] / 2**20:16.2f}")


if __name__ == "__main__":
    sys.exit(main())

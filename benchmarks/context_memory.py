"""Peak memory per rank of one training forward + backward at megatron.cp = 1, 2, 4 (the megatron
engine on gloo, fp32): how much of a long sequence's memory context parallelism divides.

Model: a small-hidden Llama (1 layer, hidden 128, 8 heads of 16, 4 KV heads, MLP 512, vocabulary
250), so at long sequences the activations (norms, q/k/v, attention output, MLP, logits and loss:
linear in the tokens a rank holds) dominate, not the weights. One micro-batch of one causal row of
``seq`` tokens (sdpa's causal kernel; packed documents on CPU would add the whole row's s x s
boolean mask on every rank, which GPUs replace by flex_attention's block mask).

peak: growth of this rank's resident memory over one ``forward_backward`` (VmHWM after resetting it
through /proc/self/clear_refs, minus VmRSS before), the largest over the CP ranks; the engine, its
DDP buffers and a warm-up step at a short sequence come before. ``ratio``: peak at cp=1 / peak.
Each (seq, cp) runs in its own job, all in one invocation, so the ratio is measured side by side.

  python benchmarks/context_memory.py                       # seq 8192 16384 32768, cp 1 2 4 (~4 min)
  python benchmarks/context_memory.py --seq 1024 --cp 1 2   # smoke
Writes benchmarks/results/context_memory.json (or --out) and prints a table.
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
RESULT = REPO / "benchmarks" / "results" / "context_memory.json"
SHAPE = dict(num_hidden_layers=1, hidden_size=128, num_attention_heads=8, num_key_value_heads=4,
             intermediate_size=512)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _micro_batch(seq: int):
    import torch
    g = torch.Generator().manual_seed(seq)
    ids = torch.randint(1, 250, (1, seq), generator=g)
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}


def _rank(rank: int, world: int, port: int, seq: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from toolkit.adapters.megatron import MegatronEngine
    from toolkit.config import validate
    from toolkit.families.tiny import tiny_model
    from toolkit.plan import build_plan
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model = tiny_model("llama", **SHAPE)
    cfg = validate({"backend": "megatron", "megatron": {"cp": world}, "data": {"seq_len": seq},
                    "train": {"global_batch_size": 1, "micro_batch_size": 1}})
    engine = MegatronEngine(build_plan(cfg, [world], hf_config=model.config), model.state_dict())
    del model
    warm = _micro_batch(8 * world)
    engine.forward_backward([warm], int(warm["labels"].numel()))
    mb = _micro_batch(seq)
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _status_kib("VmRSS")
    tic = time.perf_counter()
    engine.forward_backward([mb], int(mb["labels"].numel()))
    seconds = time.perf_counter() - tic
    peak = (_status_kib("VmHWM") - before) * 1024
    Path(out, f"rank{rank}.json").write_text(json.dumps({"peak": peak, "seconds": seconds}))
    dist.destroy_process_group()


def measure(seq: int, cp: int) -> dict:
    import torch.multiprocessing as mp

    from toolkit.parallel import free_port
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_rank, args=(cp, free_port(), seq, out), nprocs=cp, start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(cp)]
    return {"seq": seq, "cp": cp, "peak_bytes": max(r["peak"] for r in ranks),
            "seconds": max(r["seconds"] for r in ranks)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--out", type=Path, default=RESULT)
    args = parser.parse_args(argv)
    rows = []
    for seq in args.seq:
        for cp in args.cp:
            rows.append(measure(seq, cp))
            base = next(r for r in rows if r["seq"] == seq and r["cp"] == args.cp[0])
            rows[-1]["ratio"] = round(base["peak_bytes"] / rows[-1]["peak_bytes"], 2)
            print(f"seq {seq:6d} cp {cp}: peak {rows[-1]['peak_bytes'] / 2**20:8.1f} MiB per rank "
                  f"(x{rows[-1]['ratio']} less than cp={args.cp[0]}), {rows[-1]['seconds']:.1f} s", flush=True)
    result = {"benchmark": "context_memory", "model": SHAPE, "dtype": "fp32", "device": "cpu (gloo)",
              "machine": platform.machine(), "cores": os.cpu_count(), "python": sys.version.split()[0],
              "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

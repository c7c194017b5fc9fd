"""One layer's attention on the megatron path: the toolkit's core attention vs megatron-core's local one.

Both take what megatron's SelfAttention hands its core attention (q ``[s, b, heads, d]``, k and v
``[s, b, groups, d]``) and do RoPE + causal attention, forward and backward:
  toolkit   ``CoreAttention`` (toolkit/adapters/megatron/attention.py): RoPE at per-token positions
            (its ``TokenLayout`` built in the timed region, as the engine builds one per micro-batch),
            then ``megatron.attention=auto``'s kernel on this device
  local     megatron's ``RotaryEmbedding`` + ``apply_rotary_pos_emb`` (unfused, as the toolkit runs it)
            on q and k, then megatron's ``DotProductAttention`` (K/V repeated per head, s x s scores)
Shape: a Llama-1B-like layer at TP=1 (16 heads, 4 KV groups, head dim 64), micro-batch 1.

Figures per sequence length, both implementations measured in the same run:
  time     forward + backward after one warm-up, the median and the best of --repeats; the
           implementations alternate (A B B A ...) in one process per sequence length so load drift
           cancels in the ratio (on a shared machine the best is the steadier figure)
  saved    bytes autograd keeps between forward and backward (saved-tensor hooks; q, k, v excluded):
           the activation memory a training step holds per layer
  peak     peak memory growth over one forward + backward in a fresh process: on CPU the RSS
           (VmHWM after resetting it through /proc/self/clear_refs, minus VmRSS before), on a GPU
           ``torch.cuda.max_memory_allocated`` minus what was allocated before; saved tensors plus
           transient work memory, megatron's persistent score buffer included (its first call
           allocates it)

  python benchmarks/attention.py                 # seq 1024 2048 4096, fp32, ~4 min on 2 cores
  python benchmarks/attention.py --seq 256 512 --repeats 2   # smoke
  python benchmarks/attention.py --dtype bfloat16 --out OUT/attention.json   # on a GPU (gpu_check.py)
Writes benchmarks/results/attention.json (or --out) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT = REPO / "benchmarks" / "results" / "attention.json"
SHAPE = dict(heads=16, groups=4, head_dim=64, batch=1)
IMPLS = ("toolkit", "local")


# --- in the child process -----------------------------------------------------------------------------

def _setup(dtype_name: str):
    """A one-rank gloo group and megatron's model-parallel state (the local attention needs its
    global memory buffer), megatron's CPU layer on (it does nothing on a GPU)."""
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from toolkit.compat import megatron_cpu
    megatron_cpu.enable()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    ps.initialize_model_parallel(1)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    model_parallel_cuda_manual_seed(0)  # DotProductAttention forks the model-parallel RNG stream
    return getattr(torch, dtype_name)


def _config(dtype):
    import torch
    from megatron.core.transformer import TransformerConfig

    from toolkit.compat import megatron_cpu
    h, g, d = SHAPE["heads"], SHAPE["groups"], SHAPE["head_dim"]
    return TransformerConfig(num_layers=1, hidden_size=h * d, num_attention_heads=h, num_query_groups=g,
                             kv_channels=d, attention_dropout=0.0, hidden_dropout=0.0, params_dtype=dtype,
                             bf16=dtype == torch.bfloat16, masked_softmax_fusion=False, apply_rope_fusion=False,
                             **megatron_cpu.TRANSFORMER_CONFIG)


def _build(impl: str, seq: int, dtype):
    """A function of (q, k, v) -> [s, b, heads * d] for ``impl``."""
    import torch
    from megatron.core.transformer.enums import AttnMaskType

    from toolkit.adapters.megatron.attention import AttentionOptions, TokenLayout, core_attention_class
    config = _config(dtype)
    ids = torch.zeros(SHAPE["batch"], seq, dtype=torch.long, device=_device())
    if impl == "toolkit":
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, SHAPE["head_dim"], 2, dtype=torch.float) / SHAPE["head_dim"]))
        inv_freq = inv_freq.to(_device())
        core = core_attention_class()(config, 1, AttnMaskType.causal, "self", options=AttentionOptions(inv_freq=inv_freq))
        return lambda q, k, v: core(q, k, v, None, packed_seq_params=TokenLayout.of(ids))
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    rope = RotaryEmbedding(SHAPE["head_dim"], 1.0, use_cpu_initialization=_device() == "cpu")
    core = DotProductAttention(config, 1, AttnMaskType.causal, "self")

    def local(q, k, v):
        freqs = rope(seq)
        return core(apply_rotary_pos_emb(q, freqs, config), apply_rotary_pos_emb(k, freqs, config), v, None)
    return local


def _inputs(seq: int, dtype):
    import torch
    g = torch.Generator().manual_seed(0)
    b, h, kv, d = SHAPE["batch"], SHAPE["heads"], SHAPE["groups"], SHAPE["head_dim"]
    return [torch.randn(seq, b, n, d, generator=g).to(_device(), dtype).requires_grad_() for n in (h, kv, kv)]


def _device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def _step(fn, inputs) -> None:
    """One forward + backward, finished (a GPU is synchronized)."""
    import torch
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    for x in inputs:
        x.grad = None
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _saved_bytes(fn, inputs) -> int:
    """Bytes of the distinct storages autograd saves for backward, the inputs' own excluded."""
    import torch
    own = {x.untyped_storage().data_ptr() for x in inputs}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in own:
            saved[ptr] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    out.backward(torch.ones_like(out))
    return sum(saved.values())


def _vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def child_peak(impl: str, seq: int, dtype_name: str) -> dict:
    """Peak memory growth of one forward + backward in this fresh process (RSS, or the GPU's)."""
    import torch
    dtype = _setup(dtype_name)
    fn, inputs = _build(impl, seq, dtype), _inputs(seq, dtype)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _step(fn, inputs)
        return {"peak_bytes": torch.cuda.max_memory_allocated() - before}
    before = _vm("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak RSS (VmHWM) to the current RSS
    _step(fn, inputs)
    return {"peak_bytes": _vm("VmHWM") - before}


def child_time(seq: int, dtype_name: str, repeats: int) -> dict:
    """Forward + backward times of both implementations, alternating, and their saved bytes."""
    import torch
    dtype = _setup(dtype_name)
    fns = {impl: _build(impl, seq, dtype) for impl in IMPLS}
    inputs = _inputs(seq, dtype)
    with torch.no_grad():
        outs = {impl: fn(*inputs).float() for impl, fn in fns.items()}
    times = {impl: [] for impl in IMPLS}
    for impl in IMPLS:
        _step(fns[impl], inputs)  # warm-up
    for r in range(repeats):
        for impl in (IMPLS if r % 2 == 0 else IMPLS[::-1]):
            tic = time.perf_counter()
            _step(fns[impl], inputs)
            times[impl].append(time.perf_counter() - tic)
    return {"times_s": times, "saved_bytes": {impl: _saved_bytes(fns[impl], inputs) for impl in IMPLS},
            "max_abs_diff": (outs["toolkit"] - outs["local"]).abs().max().item(),
            "threads": torch.get_num_threads(), "device": torch.cuda.get_device_name() if torch.cuda.is_available()
            else platform.processor() or "cpu"}


# --- the parent ------------------------------------------------------------------------------------------

def _run_child(*args: str) -> dict:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)  # keep gpu_check's site
    env = {**os.environ, "PYTHONPATH": path, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", *args], cwd=REPO, env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def measure(seqs: list[int], dtype: str, repeats: int) -> list[dict]:
    rows = []
    for seq in seqs:
        t = _run_child("time", str(seq), dtype, str(repeats))
        peaks = {impl: _run_child("peak", impl, str(seq), dtype)["peak_bytes"] for impl in IMPLS}
        row = {"seq": seq, "dtype": dtype, **t, "peak_bytes": peaks,
               "median_s": {impl: statistics.median(t["times_s"][impl]) for impl in IMPLS},
               "best_s": {impl: min(t["times_s"][impl]) for impl in IMPLS}}
        rows.append(row)
        print(_line(row), flush=True)
    return rows


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


def _line(r: dict) -> str:
    m, b, s, p = r["median_s"], r["best_s"], r["saved_bytes"], r["peak_bytes"]
    return (f"| {r['seq']} | {m['toolkit']:.3f} ({b['toolkit']:.3f}) | {m['local']:.3f} ({b['local']:.3f}) | "
            f"{m['toolkit'] / m['local']:.2f} ({b['toolkit'] / b['local']:.2f}) | "
            f"{_mib(s['toolkit'])} | {_mib(s['local'])} | {_mib(p['toolkit'])} | {_mib(p['local'])} | "
            f"{r['max_abs_diff']:.1e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", type=Path, default=RESULT)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        kind, *rest = args.child
        result = child_time(int(rest[0]), rest[1], int(rest[2])) if kind == "time" else \
            child_peak(rest[0], int(rest[1]), rest[2])
        print(json.dumps(result))
        return
    print("| seq | toolkit s, median (best) | local s, median (best) | ratio | toolkit saved MiB | local saved MiB | "
          "toolkit peak MiB | "
          "local peak MiB | max abs diff |\n|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = measure(args.seq, args.dtype, args.repeats)
    import torch
    result = {"benchmark": "attention", "date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()),
              "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "loadavg_at_end": os.getloadavg()},
              "versions": {"torch": torch.__version__}, "command": " ".join(["python", *sys.argv]),
              "shape": SHAPE, "repeats": args.repeats, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""``toolkit train --profile``: a torch.profiler trace of a few steps and where their time went.

Each rank records ``profile.steps`` steps from ``profile.start_step`` (after warm-up) and writes its
Chrome trace (``RUN_DIR/profile/trace_rank_XXXXX.json``, opens in Perfetto or chrome://tracing)
and a JSON summary; rank 0 then writes ``RUN_DIR/profile/summary.md`` over all ranks.

What the summary counts, per profiled step:
  - collectives: the process-group ops the profiler names ``<backend>:<op>`` (``gloo:all_reduce``,
    ``nccl:_reduce_scatter_base`` ...), grouped into all-reduce, reduce-scatter, all-gather,
    broadcast and p2p (send/recv). Bytes are those of the tensor the rank hands to the op (its
    input; for all-gather the local shard). Time is the op's duration on the CPU side; on a GPU it
    is the duration of the NCCL kernels of that kind, which is when the bytes actually move.
  - bandwidth: bytes / time per kind (what nccl-tests calls algorithm bandwidth).
  - compute: step time minus collective time. Collectives that overlap compute (bucketed gradient
    reduction, prefetch) are counted in full, so compute is then a lower bound.
"""
from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

COLLECTIVE_KINDS = {"all_reduce": "all-reduce", "allreduce": "all-reduce", "reduce_scatter": "reduce-scatter",
         "reducescatter": "reduce-scatter", "all_gather": "all-gather", "allgather": "all-gather",
         "broadcast": "broadcast", "send": "p2p", "recv": "p2p", "sendrecv": "p2p"}
PROFILER_DTYPE_BYTES = {"float": 4, "double": 8, "c10::Half": 2, "c10::BFloat16": 2, "half": 2, "bfloat16": 2,
               "long int": 8, "int": 4, "signed char": 1, "unsigned char": 1, "bool": 1}
CPU_OP = re.compile(r"^(gloo|nccl|ucc|mpi|xccl|ccl):(\w+)$")


def kind_of(op: str) -> str:
    key = op.lower().lstrip("_").replace("_base", "").replace("_tensor", "").replace("_coalesced", "")
    return next((v for k, v in COLLECTIVE_KINDS.items() if key.startswith(k) or key.replace("_", "") == k), "other")


def _bytes(args: dict) -> int:
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    for shape, dtype in zip(dims, types):
        if isinstance(shape, list) and shape and all(isinstance(d, int) for d in shape):
            n = 1
            for d in shape:
                n *= d
            return n * PROFILER_DTYPE_BYTES.get(dtype, 4)
    return 0


def summarize_trace(trace: dict) -> dict:
    """Per-step compute and collective time, bytes and bandwidth from a Chrome trace (one rank)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    steps = [e for e in events if e.get("name", "").startswith("ProfilerStep#")]
    n_steps = max(len(steps), 1)
    step_us = sum(e["dur"] for e in steps) / n_steps
    cpu_time, nbytes, calls = defaultdict(float), defaultdict(int), defaultdict(int)
    for e in events:
        m = CPU_OP.match(e.get("name", ""))
        if m:
            kind = kind_of(m.group(2))
            cpu_time[kind] += e["dur"]
            nbytes[kind] += _bytes(e.get("args", {}))
            calls[kind] += 1
    gpu_time = defaultdict(float)
    for e in events:  # NCCL kernels: when the bytes move on a GPU
        name = e.get("name", "")
        if e.get("cat") == "kernel" and "nccl" in name.lower():
            gpu_time[kind_of(re.sub(r"^nccl(Dev)?Kernel_", "", name).split("_")[0])] += e["dur"]
    time_us = gpu_time if gpu_time else cpu_time
    kinds = {}
    for kind in sorted(set(cpu_time) | set(gpu_time)):
        t = time_us.get(kind, 0.0) / n_steps
        b = nbytes.get(kind, 0) / n_steps
        kinds[kind] = {"ms_per_step": t / 1e3, "calls_per_step": calls.get(kind, 0) / n_steps,
                       "mb_per_step": b / 1e6, "gb_per_s": (b / (t / 1e6) / 1e9) if t else None}
    comm_ms = sum(k["ms_per_step"] for k in kinds.values())
    return {"steps": len(steps), "step_ms": step_us / 1e3, "comm_ms": comm_ms,
            "compute_ms": max(step_us / 1e3 - comm_ms, 0.0), "collectives": kinds,
            "timing_source": "nccl kernels" if gpu_time else "cpu-side collective ops"}


class StepProfiler:
    """torch.profiler over steps [start, start + n); ``before_step``/``after_step`` around every step."""

    def __init__(self, run_dir: Path, rank: int, start_step: int, steps: int):
        self.dir = Path(run_dir) / "profile"
        self.rank, self.start, self.steps = rank, max(start_step, 1), steps
        self._prof = None
        self.summary: dict | None = None

    def before_step(self, step: int) -> None:
        """``step``: the 1-based number of the step about to run."""
        warmup = 1 if self.start > 1 else 0  # one unrecorded step lets the profiler settle
        if self._prof is None and self.summary is None and step == self.start - warmup:
            import torch
            from torch.profiler import ProfilerActivity, profile, schedule
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self._prof = profile(activities=activities, record_shapes=True, on_trace_ready=self._export,
                                 schedule=schedule(wait=0, warmup=warmup, active=self.steps, repeat=1))
            self._prof.__enter__()

    def after_step(self, step: int) -> bool:
        """True once, after the last profiled step (this rank's files are then written)."""
        if self._prof is None:
            return False
        self._prof.step()
        if step < self.start + self.steps - 1:
            return False
        self._prof.__exit__(None, None, None)
        self._prof = None
        return True  # on every rank at the same step: the caller's barrier may rely on it

    def _export(self, prof) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"trace_rank_{self.rank:05d}.json"
        prof.export_chrome_trace(str(trace))
        self.summary = summarize_trace(json.loads(trace.read_text()))
        (self.dir / f"summary_rank_{self.rank:05d}.json").write_text(json.dumps(self.summary, indent=2))


def write_summary(profile_dir: Path) -> Path:
    """``summary.md`` over every rank's summary: the mean and the slowest rank per figure."""
    ranks = [json.loads(p.read_text()) for p in sorted(Path(profile_dir).glob("summary_rank_*.json"))]
    lines = [f"# Communication profile ({len(ranks)} ranks, {ranks[0]['steps']} steps each; "
             f"collective time from {ranks[0]['timing_source']})", "",
             "| per step | mean over ranks | slowest rank |", "|---|---|---|"]
    for key in ("step_ms", "compute_ms", "comm_ms"):
        values = [r[key] for r in ranks]
        lines.append(f"| {key.replace('_ms', '')} ms | {sum(values) / len(values):.1f} | {max(values):.1f} |")
    lines += ["", "| collective | calls/step | MB/step | ms/step | GB/s | share of step |", "|---|---|---|---|---|---|"]
    kinds = sorted({k for r in ranks for k in r["collectives"]})
    for kind in kinds:
        rows = [r["collectives"][kind] for r in ranks if kind in r["collectives"]]
        mean = {f: sum(row[f] for row in rows) / len(rows) for f in ("calls_per_step", "mb_per_step", "ms_per_step")}
        bw = mean["mb_per_step"] / 1e3 / (mean["ms_per_step"] / 1e3) if mean["ms_per_step"] else None
        share = mean["ms_per_step"] / (sum(r["step_ms"] for r in ranks) / len(ranks))
        lines.append(f"| {kind} | {mean['calls_per_step']:.1f} | {mean['mb_per_step']:.2f} | {mean['ms_per_step']:.1f} "
                     f"| {'-' if bw is None else f'{bw:.2f}'} | {share:.0%} |")
    lines += ["", "Traces: `trace_rank_XXXXX.json` (Perfetto / chrome://tracing). How the figures are counted: "
              "`toolkit/observe/profile.py`."]
    out = Path(profile_dir) / "summary.md"
    out.write_text("\n".join(lines) + "\n")
    return out

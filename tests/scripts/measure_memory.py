"""One rank of a memory measurement: for each configuration, the engine the trainer builds and a
few steps on random tokens, then what it holds.

Run under `toolkit supervise --nproc N -- tests/scripts/measure_memory.py OUT.json CONFIGS.json`,
CONFIGS.json a list of ``--set`` override lists (one engine each, built one after the other in this
process). Measured, as bytes of live tensor storage (every distinct storage a live tensor holds,
found through the garbage collector, minus what was live before that engine was built):
  state_bytes  after a steady step: weights + optimizer state
  step_bytes   the highest count after a backward or when the optimizer steps: + gradients
               (the model-state peak); the lower of two steps' peaks
and, for the first configuration only, resident memory (VmRSS, VmHWM) against a baseline taken
before the model existed. Rank r writes OUT.json.r: a list, one result per configuration.
"""
from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def rss(field: str = "VmRSS") -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def live_tensor_bytes() -> int:
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
            st = obj.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _count_at_model_state_peaks(engine) -> list[int]:
    """Live tensor bytes after each backward (gradients kept through accumulation) and when the
    optimizer steps (gradients, weights and optimizer state all live)."""
    seen: list[int] = []

    def counted(inner, before: bool):
        def call(*args, **kwargs):
            if before:
                seen.append(live_tensor_bytes())
            result = inner(*args, **kwargs)
            if not before:
                seen.append(live_tensor_bytes())
            return result
        return call
    opt = getattr(engine, "optimizer", None) or engine.engine.optimizer
    opt.step = counted(opt.step, before=True)
    if hasattr(engine, "engine"):  # DeepSpeed: the engine's backward, which reduces at the boundary
        engine.engine.backward = counted(engine.engine.backward, before=False)
    return seen


def measure(overrides: list[str], out_dir: Path, with_rss: bool) -> dict:
    from toolkit.config import load_config
    from toolkit.plan import build_plan
    from toolkit.train.worker import build_engine
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = build_plan(load_config(None, overrides), [world])
    cfg, vocab = plan.config, plan.model.vocab
    dist.barrier()
    # Everything live now (the libraries, the previous configuration's leftovers) is frozen: each count's
    # collection and walk see only what this engine made, where they walked the whole heap (~1 s each,
    # 8 counts per configuration). A frozen tensor is counted by no count, ``before`` included: as
    # before, what was live before the engine cancels out.
    gc.collect()
    gc.freeze()
    before, base_rss = live_tensor_bytes(), rss()
    engine = build_engine(plan, out_dir, rank)
    n_micro = cfg.train.global_batch_size // (cfg.train.micro_batch_size * engine.dp_size)
    ids = torch.randint(0, vocab, (n_micro, cfg.train.micro_batch_size, cfg.data.seq_len),
                        generator=torch.Generator().manual_seed(0))
    batches = [{"input_ids": x, "labels": x.clone()} for x in ids]
    tokens = cfg.train.global_batch_size * cfg.data.seq_len
    for _ in range(2):  # optimizer state exists after the first step; the second is steady
        engine.train_step(batches, tokens, 1e-4)
    result = {"overrides": overrides, "state_bytes": live_tensor_bytes() - before}
    if with_rss:
        result["state_rss_bytes"] = rss() - base_rss
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    at_step = _count_at_model_state_peaks(engine)
    peaks = []
    for _ in range(2):  # the lower of two steps' peaks: a transient allocation is not model state
        engine.train_step(batches, tokens, 1e-4)  # (seen once: +2 MiB on one ZeRO-2 rank under load)
        peaks.append(max(at_step))
        at_step.clear()
    result["step_bytes"] = min(peaks) - before
    if with_rss:
        result["peak_rss_bytes"] = rss("VmHWM") - base_rss
    del engine, batches
    if cfg.backend == "megatron":  # the next configuration may have another TP/PP layout
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
    dist.barrier()
    return result


def main(out: str, configs: str) -> None:
    from toolkit.parallel import init_process_group
    init_process_group()
    import deepspeed
    # DeepSpeed's CPU comm layer maps a shared-memory workspace per rank at init (used only by its
    # inference all-reduce), and the engine imports its ZeRO code lazily: both before any baseline.
    deepspeed.init_distributed(dist_backend="gloo")
    import deepspeed.runtime.zero.stage3  # noqa: F401
    import deepspeed.runtime.zero.stage_1_and_2  # noqa: F401
    out_dir = Path(out).parent / "run"
    out_dir.mkdir(parents=True, exist_ok=True)
    results = [measure(o, out_dir, with_rss=i == 0) for i, o in enumerate(json.loads(Path(configs).read_text()))]
    Path(f"{out}.{dist.get_rank()}").write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

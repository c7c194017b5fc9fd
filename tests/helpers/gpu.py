"""What the GPU layer (tests/gpu, ``pytest -m gpu``) and its CPU rehearsal (tests/e2e/test_gpu_check.py)
share: the GPU-only marks, the device, and the references of the checks both run."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from tests.helpers.attention import CASES
from tests.helpers.measure import measure
from tests.helpers.runs import run_cli

REHEARSAL = not torch.cuda.is_available() and os.environ.get("TOOLKIT_GPU_TESTS_ON_CPU") == "1"
GPU_ONLY = [pytest.mark.gpu,
            pytest.mark.skipif(not (torch.cuda.is_available() or REHEARSAL),
                               reason="needs a GPU (or TOOLKIT_GPU_TESTS_ON_CPU=1 to rehearse on the CPU)")]
"""The marks of a GPU test module (its ``pytestmark``)."""
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = "bf16" if torch.cuda.is_available() else "fp32"
"""What the GPU layer trains in: bf16 on the device; fp32 on the CPU rehearsal (DeepSpeed's CPU accelerator)."""
SMALL = ["--nproc", "1", "--set", "data.seq_len=128", "--set", "train.global_batch_size=8",
         "--set", "train.micro_batch_size=4", "--set", "train.eval_every=4", "--set", "train.log_every=1",
         "--set", "train.warmup_steps=2"]


def toolkit_train(run_dir: Path, *sets: str, env: dict | None = None, check: bool = True):
    """``toolkit train`` on one rank with the GPU layer's small shape, as a user runs it."""
    args = ["train", "--run-dir", str(run_dir), *SMALL]
    for s in sets:
        args += ["--set", s]
    return run_cli(args, env=env, check=check, timeout=900)


def records(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl's step rows by step."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


def resume_events(run_dir: Path) -> list[dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if r.get("event") == "resume"]


def expected_kernel(case: str) -> str:
    """``auto`` on CUDA without dropout: flex for a mask (documents, window) or a softcap, else sdpa."""
    docs, window, softcap = CASES[case]
    return "flex" if docs is not None or window is not None or softcap is not None else "sdpa"


def deepspeed_scales(skipped: list[bool], initial: float, hysteresis: int = 2, window: int = 1000) -> list[float]:
    """The loss scale after each step as DeepSpeed's own ``DynamicLossScaler`` moves it, given which
    steps overflowed (the reference a run's logged ``loss_scale`` must equal)."""
    from unittest import mock

    from deepspeed.runtime.fp16 import loss_scaler
    scaler = loss_scaler.DynamicLossScaler(init_scale=initial, scale_window=window, min_scale=1,
                                           delayed_shift=hysteresis, consecutive_hysteresis=False,
                                           raise_error_at_min_scale=False)
    out = []
    with mock.patch.object(loss_scaler.dist, "get_rank", return_value=0):  # it logs on rank 0; no group here
        for overflow in skipped:
            scaler.update_scale(overflow)
            out.append(float(scaler.cur_scale))
    return out


def megatron_scales(skipped: list[bool], initial: float, hysteresis: int = 2, window: int = 1000,
                    min_scale: float = 1.0) -> list[float]:
    """The loss scale after each step by megatron-core's ``DynamicGradScaler.update`` rule
    (megatron/core/optimizer/grad_scaler.py, restated here: its tensors live on CUDA): an overflow
    resets the growth count and spends one hysteresis, halving once none is left; ``window`` clean
    steps in a row double the scale and restore the hysteresis."""
    scale, growth, hyst, out = initial, 0, hysteresis, []
    for overflow in skipped:
        if overflow:
            growth, hyst = 0, hyst - 1
            if hyst <= 0:
                scale = max(scale * 0.5, min_scale)
        else:
            growth += 1
            if growth == window:
                growth, hyst, scale = 0, hysteresis, scale * 2
        out.append(scale)
    return out


def check_scales(r: dict[int, dict], expected_fn) -> None:
    """Every step's logged scale equals the reference's, from the logged overflows; a reader that
    returned a constant (or the initial scale) fails at the second forced overflow."""
    steps = sorted(r)
    skipped = [bool(r[s]["skipped"]) for s in steps]
    expected = expected_fn(skipped, initial=r[steps[0]]["loss_scale"])  # hysteresis 2: step 1 logs the initial
    logged = [r[s]["loss_scale"] for s in steps]
    measure("loss scales logged", logged, expected)
    assert logged == expected, list(zip(steps, skipped, logged, expected))


def check_router_stats(r: dict[int, dict], tokens: int, top_k: int, layers: int) -> None:
    """Each step's router counts route every token of the global batch ``top_k`` times in every layer
    (the allgather dispatcher drops none), and ``moe_load_max`` is the busiest expert's count over an
    even share, recomputed from those counts (a reader of constants or zeros fails both)."""
    for s, row in r.items():
        counts = row["moe_expert_tokens"]
        assert len(counts) == layers and [sum(c) for c in counts] == [tokens * top_k] * layers, (s, counts)
        load = max(max(c) / (sum(c) / len(c)) for c in counts)
        assert row["moe_load_max"] == pytest.approx(load, abs=1e-4), (s, row["moe_load_max"], load)
        assert math.isfinite(row["moe_aux_loss"]), s
    measure("moe_load_max per step", [r[s]["moe_load_max"] for s in sorted(r)], "recomputed from moe_expert_tokens")

"""DeepSpeed's Adam kernels where they load, torch's AdamW where they do not (``adapters/deepspeed/optimizer.py``).

A machine without the toolchain to build FusedAdam (a GPU box without nvcc, or with nvcc's CUDA
not torch's) or DeepSpeedCPUAdam (offload) crashed in ``deepspeed.initialize``. Here the build is
made to fail in the rank (the op builder's ``load`` raises, as a failed JIT build does) and the same
engine is stepped on the same batches: the fallback is torch's AdamW with the very hyperparameters
of each param group, and the losses and weights follow DeepSpeed's kernel; a whole run through the
worker records the choice in metrics.jsonl."""
from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.parity import batches
from tests.helpers.ranks import run_ranks
from tests.helpers.runs import worker_ranks
from toolkit.config import validate
from toolkit.families.tiny import tiny_model
from toolkit.loss import IGNORE_INDEX

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo suite")

OFFLOAD = {False: {"stage": 2}, True: {"stage": 2, "offload_optimizer": True}}
BUILDER = {False: "FusedAdamBuilder", True: "CPUAdamBuilder"}
STEPS = 3
# Measured here (CPU, 3 steps, fp32): losses equal to the last digit, weights within 5.7e-7 (norm of the
# difference / norm, worst parameter); one missed weight decay step alone moves them by 1e-3.
LOSS_RTOL = 1e-6
WEIGHT_RTOL = 5e-6


def failing_build(builder: str):
    """The op builder's ``load`` raises, as a JIT build without nvcc/ninja/headers does."""
    from deepspeed.ops import op_builder
    cls = getattr(op_builder, builder)

    def load(self, verbose=True):
        raise RuntimeError(f"simulated: {self.NAME} build failed (nvcc not found)")
    return cls, load


def _train(offload: bool, fail: bool) -> dict:
    from toolkit.adapters.deepspeed import DeepSpeedEngine
    from toolkit.plan import build_plan
    model = tiny_model("llama")
    cfg = validate({"zero": OFFLOAD[offload], "train": {"global_batch_size": 4, "micro_batch_size": 1,
                                                         "weight_decay": 0.1}})
    cls, raising = failing_build(BUILDER[offload])
    saved = cls.load
    if fail:
        cls.load = raising
    try:
        engine = DeepSpeedEngine(build_plan(cfg, [1], hf_config=model.config), model)
    finally:
        cls.load = saved
    micro = batches(model.config.vocab_size)
    tokens = sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro)
    losses = [engine.train_step(micro, tokens, lr=1e-2 * (s + 1) / STEPS).loss for s in range(STEPS)]
    basic = engine.engine.basic_optimizer
    out = {"losses": losses, "optimizer": type(basic).__module__ + "." + type(basic).__name__,
           "fused": basic.defaults.get("fused"), "record": engine.setup_records[0],
           "groups": [{k: list(v) if k == "betas" else v for k, v in g.items() if k in ("lr", "betas", "eps", "weight_decay")}
                      for g in basic.param_groups],
           "weights": {n: p.detach().clone() for n, p in engine.module.named_parameters()}}
    engine.engine.destroy()
    return out


def _both_ways(rank, world, offload):
    return {"built": _train(offload, fail=False), "fallback": _train(offload, fail=True)}


@pytest.mark.parametrize("offload", [False, True], ids=["fused_adam", "cpu_adam"])
def test_failed_build_falls_back_to_torch_adamw_with_the_same_math(offload, tmp_path):
    got = run_ranks(_both_ways, 1, tmp_path, offload)[0]
    built, fallback = got["built"], got["fallback"]
    kernel = "DeepSpeedCPUAdam" if offload else "FusedAdam"
    assert built["optimizer"].endswith(kernel) and built["record"] == {
        "event": "optimizer", "optimizer": kernel, "fallback_reason": None}
    assert fallback["optimizer"] == "torch.optim.adamw.AdamW" and fallback["fused"] is True
    assert fallback["record"]["optimizer"] == "torch.optim.AdamW(fused=True)"
    assert f"DeepSpeed's {kernel} did not load: RuntimeError: simulated" in fallback["record"]["fallback_reason"]
    assert fallback["groups"] == built["groups"]  # lr, betas, eps and decay per group, as DeepSpeed's
    assert fallback["losses"] == pytest.approx(built["losses"], rel=LOSS_RTOL)
    assert fallback["losses"][-1] < fallback["losses"][0]
    for name, w in built["weights"].items():
        moved = torch.linalg.vector_norm(fallback["weights"][name] - w) / torch.linalg.vector_norm(w)
        assert moved < WEIGHT_RTOL, (name, moved.item())


def _one_rank_fails(rank, world):
    """``with_available_adam`` where only rank 1's FusedAdam build fails."""
    from toolkit.adapters.deepspeed.optimizer import with_available_adam
    cls, raising = failing_build(BUILDER[False])
    if rank == 1:
        cls.load = raising
    resolved, choice = with_available_adam({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                            "zero_optimization": {"stage": 2}})
    return {"params": resolved["optimizer"]["params"], **choice.record()}


def test_when_one_ranks_build_fails_every_rank_falls_back(tmp_path):
    """Ranks must step alike: the kernel that built on rank 0 is not used there either."""
    got = run_ranks(_one_rank_fails, 2, tmp_path)
    assert [g["optimizer"] for g in got] == ["torch.optim.AdamW(fused=True)"] * 2, got
    assert got[0]["params"] == got[1]["params"] == {"lr": 1e-3, "torch_adam": True, "fused": True}
    assert got[0]["fallback_reason"] == "DeepSpeed's FusedAdam did not load: it did not load on another rank"
    assert "RuntimeError: simulated" in got[1]["fallback_reason"]


def _failing_fusedadam(rank, run_dir) -> None:
    """A rank's setup (``worker_ranks``): its FusedAdam build fails."""
    cls, raising = failing_build(BUILDER[False])
    cls.load = raising


def _run_with_failing_build(run_dir, data_cache, *sets: str) -> None:
    """``toolkit train`` on one rank whose FusedAdam build fails."""
    assert worker_ranks(run_dir, data_cache, _failing_fusedadam, "zero.stage=2", *sets) == [0]


def optimizer_records(run_dir) -> list[dict]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r.get("event") == "optimizer"]


def test_a_run_whose_build_fails_trains_and_records_the_choice(tmp_path, data_cache):
    from toolkit.observe.metrics import read_metrics
    run_dir = tmp_path / "run"
    _run_with_failing_build(run_dir, data_cache)
    chosen = optimizer_records(run_dir)
    assert len(chosen) == 1 and chosen[0]["optimizer"] == "torch.optim.AdamW(fused=True)"
    assert "FusedAdam did not load" in chosen[0]["fallback_reason"]
    losses = [r["loss"] for _, r in sorted(read_metrics(run_dir).items())]
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert json.loads((run_dir / "ds_config.json").read_text())["optimizer"]["params"]["torch_adam"] is True


def test_a_fusedadam_checkpoint_resumes_under_the_fallback(tmp_path, data_cache):
    """Saved at step 3 with DeepSpeed's FusedAdam, resumed where it does not build: the moments and
    step count carry over, and the losses are the uninterrupted FusedAdam run's (measured: equal)."""
    from tests.helpers.runs import losses, resumes, train
    uninterrupted, switched = tmp_path / "fused", tmp_path / "switched"
    train(uninterrupted, data_cache, "zero.stage=2", nproc=1)
    train(switched, data_cache, "zero.stage=2", "train.steps=3", "checkpoint.every=3", nproc=1)
    _run_with_failing_build(switched, data_cache, "checkpoint.every=3", "resume=auto")
    assert [r["optimizer"] for r in optimizer_records(switched)] == ["FusedAdam", "torch.optim.AdamW(fused=True)"]
    assert resumes(switched) == [("step_00000003", 3, "as saved")]
    assert losses(switched) == pytest.approx(losses(uninterrupted), rel=LOSS_RTOL)


def _zero0_adam_steps(rank, world, dtype):
    """Adam's step count and the masters' distance from the weights, after init and one step."""
    from toolkit.adapters.deepspeed import DeepSpeedEngine
    from toolkit.plan import build_plan
    model = tiny_model("llama")
    cfg = validate({"zero": {"stage": 0}, "model": {"dtype": dtype},
                    "train": {"global_batch_size": 2, "micro_batch_size": 1, "weight_decay": 0.1}})
    engine = DeepSpeedEngine(build_plan(cfg, [1], hf_config=model.config), model)
    wrapper = engine.engine.optimizer

    def masters_minus_weights() -> float:
        return max((m - torch.cat([w.detach().float().flatten() for w in ws])).abs().max().item()
                   for m, ws in zip(wrapper.fp32_groups_flat, wrapper.fp16_groups))
    at_start = (dict(wrapper.optimizer.state), masters_minus_weights())
    micro = batches(model.config.vocab_size, n_micro=2)
    engine.train_step(micro, sum(int((mb["labels"] != IGNORE_INDEX).sum()) for mb in micro), lr=1e-3)
    steps = sorted({int(s["step"]) for s in wrapper.optimizer.state.values()})
    engine.engine.destroy()
    return {"state_at_start": len(at_start[0]), "masters_off_at_start": at_start[1], "steps_after_one": steps}


def test_zero0_low_precision_adam_starts_at_step_one(tmp_path):
    """DeepSpeed's FP16_Optimizer (ZeRO-0, bf16/fp16) steps Adam on zero gradients when it is built:
    its step count was 1 before training and the masters had one weight decay (the bias corrections
    then ran a step behind: test_precision.py's ZeRO-0 drift). The adapter undoes that step."""
    got = run_ranks(_zero0_adam_steps, 1, tmp_path, "bf16")[0]
    assert got == {"state_at_start": 0, "masters_off_at_start": 0.0, "steps_after_one": [1]}

"""--profile (compute vs collectives from a torch.profiler trace), MFU's formula, and the metrics
sinks read back: TensorBoard's event files and the real wandb library's offline run."""
from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest

from tests.helpers.runs import run_in_process, train
from toolkit.estimate.flops import flops_per_token, peak_flops
from toolkit.observe.profile import kind_of, summarize_trace
from toolkit.plan.model import model_spec


def _event(name, dur, dims=None, dtype="float", cat="cpu_op"):
    args = {"Input Dims": [dims], "Input type": [dtype]} if dims else {}
    return {"ph": "X", "name": name, "dur": dur, "cat": cat, "args": args}


def test_summary_splits_collectives_by_kind_with_bytes_and_bandwidth():
    trace = {"traceEvents": [
        _event("ProfilerStep#3", 10_000), _event("ProfilerStep#4", 10_000),
        _event("gloo:all_reduce", 1_000, [1000, 250]), _event("gloo:all_reduce", 1_000, [1000, 250]),
        _event("gloo:_reduce_scatter_base", 500, [500], "c10::BFloat16"), _event("gloo:send", 200, [10]),
        _event("aten::mm", 5_000)]}
    s = summarize_trace(trace)
    assert s["steps"] == 2 and s["step_ms"] == 10.0
    ar = s["collectives"]["all-reduce"]
    assert ar["calls_per_step"] == 1 and ar["mb_per_step"] == 1.0 and ar["ms_per_step"] == 1.0
    assert ar["gb_per_s"] == pytest.approx(1.0)
    assert s["collectives"]["reduce-scatter"]["mb_per_step"] == 0.0005
    assert s["collectives"]["p2p"]["calls_per_step"] == 0.5
    assert s["comm_ms"] == pytest.approx(1.35) and s["compute_ms"] == pytest.approx(8.65)
    assert s["timing_source"] == "cpu-side collective ops"


def test_on_a_gpu_the_nccl_kernels_time_the_collectives():
    trace = {"traceEvents": [_event("ProfilerStep#1", 10_000), _event("nccl:all_reduce", 50, [1000]),
                             _event("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 2_000, cat="kernel")]}
    s = summarize_trace(trace)
    assert s["collectives"]["all-reduce"]["ms_per_step"] == 2.0 and s["timing_source"] == "nccl kernels"


@pytest.mark.parametrize("op,kind", [("allreduce", "all-reduce"), ("_allgather_base", "all-gather"),
                                     ("all_gather_into_tensor_coalesced", "all-gather"), ("recv", "p2p"),
                                     ("reduce_scatter_tensor", "reduce-scatter"), ("broadcast", "broadcast"),
                                     ("barrier", "other")])
def test_collective_names_map_to_kinds(op, kind):
    assert kind_of(op) == kind


def test_flops_per_token_is_the_documented_formula():
    from transformers import LlamaConfig
    c = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    kv = 64 // 4 * 2
    layer = 64 * (64 + 2 * kv) + 64 * 64 + 3 * 64 * 128 + 2 * 64
    n_without_input_embedding = 2 * layer + 64 + 1000 * 64
    assert flops_per_token(model_spec(c), 256) == 6 * n_without_input_embedding + 12 * 2 * 64 * 256
    tied = LlamaConfig(**{**c.to_dict(), "tie_word_embeddings": True})
    assert flops_per_token(model_spec(tied), 256) == flops_per_token(model_spec(c), 256)  # the head counted once


def test_peaks_by_device_and_dtype():
    assert peak_flops("bf16", "NVIDIA H200") == 989e12 and peak_flops("fp32", "NVIDIA A100-SXM4-80GB") == 156e12
    assert peak_flops("bf16", "Some Unknown Accelerator") is None


def wandb_records(run_dir: Path) -> list:
    """The records of the offline W&B run(s) under ``run_dir``, parsed with wandb's own protobuf
    definitions from its transaction log (``run-<id>.wandb``: a LevelDB-style log of 32 KiB blocks,
    7-byte record headers, after wandb's 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2
    out = []
    for log in sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb")):
        for raw in _log_records(log.read_bytes()):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            out.append(record)
    return out


def _log_records(data: bytes, block: int = 32768):
    assert data[:4] == b":W&B", "not a W&B transaction log"
    pos, pending = 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if room >= 7 else (0, 0, 0)
        if kind == 0:  # the rest of a block too short for a header, or zero padding
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            yield pending
            pending = b""


def tensorboard_scalars(run_dir: Path, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


@pytest.mark.slow
def test_profile_run_writes_summary_and_logs_to_tensorboard_and_wandb(tmp_path, data_cache):
    """ZeRO-2 on 2 ranks with --profile and a W&B project: the profile summary; TensorBoard's event
    files and the real wandb library's offline run, both read back, hold every step's loss."""
    import hashlib
    run_dir = tmp_path / "run"
    train(run_dir, data_cache, "profile.enabled=true", "profile.start_step=3", "profile.steps=2",
          "metrics.wandb_project=toolkit-test", "zero.stage=2", env={"WANDB_MODE": "offline"})
    summaries = [json.loads((run_dir / "profile" / f"summary_rank_{r:05d}.json").read_text()) for r in range(2)]
    for s in summaries:
        assert s["steps"] == 2 and s["step_ms"] > 0
        assert sum(k["mb_per_step"] for k in s["collectives"].values()) > 0  # ZeRO-2 moves gradients
    assert (run_dir / "profile" / "trace_rank_00000.json").stat().st_size > 0
    assert "| collective |" in (run_dir / "profile" / "summary.md").read_text()
    print("\n" + (run_dir / "profile" / "summary.md").read_text())  # README quotes this table
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any("mfu" in r for r in rows)  # no GPU: no peak, no MFU
    want = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    assert [s for s, _ in want] == [1, 2, 3, 4, 5, 6]
    assert tensorboard_scalars(run_dir, "loss") == [(s, pytest.approx(v, rel=1e-7)) for s, v in want]  # float32
    records = wandb_records(run_dir)
    [run] = [r.run for r in records if r.HasField("run")]
    assert run.run_id == hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:16]  # one W&B run per run dir
    assert (run.project, run.display_name) == ("toolkit-test", "run")
    assert {u.key for u in run.config.update} >= {"train", "zero", "metrics"}
    history = [{i.key or ".".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in records if r.HasField("history")]
    assert [(h["_step"], h["loss"]) for h in history if "loss" in h] == want
    assert any(r.HasField("exit") for r in records)  # finished, not crashed


def test_wandb_project_without_wandb_is_a_clear_error(tmp_path, monkeypatch):
    """wandb is an optional extra: without it, the run is refused before launch, naming the fix."""
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError, as when not installed
    proc = run_in_process(["train", "--run-dir", str(tmp_path / "r"), "--set", "metrics.wandb_project=x"], check=False)
    assert proc.returncode != 0
    assert "pip install 'toolkit[wandb]'" in proc.stderr + proc.stdout
    assert not (tmp_path / "r" / "metrics.jsonl").exists()

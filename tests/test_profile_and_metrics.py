"""--profile (compute vs collectives from a torch.profiler trace), MFU's formula, W&B logging."""
from __future__ import annotations

import json

import pytest

from tests.conftest import REPO, run_in_process, train
from toolkit.plan.flops import flops_per_token, peak_flops
from toolkit.plan.model import model_spec
from toolkit.observe.profile import kind_of, summarize_trace


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


FAKE_WANDB = '''
import json, os
_log = os.environ["FAKE_WANDB_LOG"]
def _write(kind, **kw):
    with open(_log, "a") as f:
        f.write(json.dumps({"call": kind, **kw}) + "\\n")
class _Run:
    def log(self, data, step=None): _write("log", data=data, step=step)
    def finish(self): _write("finish")
def init(**kw):
    _write("init", project=kw["project"], id=kw["id"], resume=kw["resume"], has_config=bool(kw["config"]))
    return _Run()
'''


@pytest.mark.slow
def test_profile_run_writes_summary_and_logs_to_wandb(tmp_path, data_cache):
    """ZeRO-2 on 2 ranks with --profile and a W&B project (a stand-in wandb module records calls)."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "wandb.py").write_text(FAKE_WANDB)
    log = tmp_path / "wandb_calls.jsonl"
    run_dir = tmp_path / "run"
    env = {"PYTHONPATH": f"{fake}:{REPO}", "FAKE_WANDB_LOG": str(log)}
    train(run_dir, data_cache, "profile.enabled=true", "profile.start_step=3", "profile.steps=2",
          "metrics.wandb_project=toolkit-test", "zero.stage=2", env=env,
          isolated=True)  # the stand-in wandb is found through PYTHONPATH: new processes only
    summaries = [json.loads((run_dir / "profile" / f"summary_rank_{r:05d}.json").read_text()) for r in range(2)]
    for s in summaries:
        assert s["steps"] == 2 and s["step_ms"] > 0
        assert sum(k["mb_per_step"] for k in s["collectives"].values()) > 0  # ZeRO-2 moves gradients
    assert (run_dir / "profile" / "trace_rank_00000.json").stat().st_size > 0
    assert "| collective |" in (run_dir / "profile" / "summary.md").read_text()
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert calls[0] == {"call": "init", "project": "toolkit-test", "id": calls[0]["id"], "resume": "allow",
                        "has_config": True}
    assert [c["step"] for c in calls if c["call"] == "log" and "loss" in c["data"]] == [1, 2, 3, 4, 5, 6]
    assert calls[-1]["call"] == "finish"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert not any("mfu" in r for r in rows)  # no GPU: no peak, no MFU


def test_wandb_project_without_wandb_is_a_clear_error(tmp_path):
    try:
        import wandb  # noqa: F401
        pytest.skip("wandb is installed here")
    except ImportError:
        pass
    proc = run_in_process(["train", "--run-dir", str(tmp_path / "r"), "--set", "metrics.wandb_project=x"], check=False)
    assert proc.returncode != 0
    assert "pip install 'toolkit[wandb]'" in proc.stderr + proc.stdout

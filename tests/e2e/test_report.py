"""toolkit report: plots and summary from metrics.jsonl / events.jsonl (a synthetic run: fast)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from tests.helpers.runs import run_cli, run_in_process
from toolkit.config import ConfigError
from toolkit.observe.report import write_report

T0 = 1_800_000_000.0
PURPLE, RED = (0x94, 0x67, 0xBD), (0xD6, 0x27, 0x28)  # matplotlib's tab:purple, tab:red


def _fake_run(run_dir, with_restart: bool = True):
    """60 steps; a kill at step 37 and a resume from the step-30 checkpoint that re-logs 31..37."""
    lines = []
    for step in range(1, 61):
        t = T0 + step * 0.5 + (20 if with_restart and step > 30 else 0)
        lines.append({"step": step, "loss": 8 * math.exp(-step / 30) + 2, "lr": 1e-3 * min(1, step / 10),
                      "grad_norm": 1 / math.sqrt(step), "tokens": 512, "tokens_per_s": 1000 + step, "step_s": 0.5,
                      "elapsed_s": step * 0.5, "time": t})
        if step % 20 == 0:
            lines.append({"step": step, "eval_loss": 8 * math.exp(-step / 30) + 2.2, "eval_tokens": 1000, "time": t})
        if with_restart and step == 37:  # the first attempt got this far; the resumed one re-logs 31..
            lines += [{"event": "resume", "step": 30, "checkpoint": "step_00000030", "time": t + 15}]
    run_dir.mkdir()
    body = "\n".join(json.dumps(r) for r in lines)
    (run_dir / "metrics.jsonl").write_text(body + '\n{"step": 61, "loss": 2.0, "lr"')  # cut by a kill -9
    (run_dir / "config.yaml").write_text("backend: deepspeed\nnproc: 2\nmodel: {name_or_path: /m/tiny-llama, "
                                         "dtype: fp32}\ntrain: {steps: 60}\nzero: {stage: 2}\n")
    if with_restart:
        events = [{"time": T0 + 19, "kind": "failure", "rank": 1, "exit_code": -9, "step": 37},
                  {"time": T0 + 20, "kind": "restart", "attempt": 1},
                  {"time": T0 + 33, "kind": "recovered", "step": 31, "time_to_recover_s": 14.2,
                   "breakdown_s": {"backoff": 1.0, "torn_down": 1.2, "rendezvous": 1.6, "ranks_started": 1.7,
                                   "checkpoint_loaded": 12.9, "first_step_done": 14.1}}]
        (run_dir / "events.jsonl").write_text("\n".join(json.dumps(e) for e in events) + "\n")


def _has_colour(png, rgb, tolerance=12) -> bool:
    import matplotlib.image as mpimg
    pixels = (mpimg.imread(png)[..., :3] * 255).astype(int)
    return bool((np.abs(pixels - np.array(rgb)).max(axis=-1) <= tolerance).sum() > 50)


def test_report_writes_plots_and_summary(tmp_path):
    run_dir = tmp_path / "run"
    _fake_run(run_dir)
    out = write_report(run_dir)
    for name in ("loss", "lr", "grad_norm", "throughput"):
        assert (out / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (out / "report.md").read_text()
    assert "- backend deepspeed (ZeRO-2), 2 rank(s) per node, model `tiny-llama` (fp32)" in md
    assert "- steps logged: 60 (last 60 of 60)" in md
    assert "- eval loss: best 3.2827 at step 60; last 3.2827 at step 60" in md
    assert "events: failure x1, recovered x1, restart x1" in md and "time to recover: 14.2 s" in md
    assert ("recovery to step 31: backoff 1.00 s, torn down 1.20 s, rendezvous 1.60 s, ranks started 1.70 s, "
            "checkpoint loaded 12.90 s, first step done 14.10 s") in md
    assert "resumed at step(s): 30" in md and "![loss](loss.png)" in md
    assert _has_colour(out / "loss.png", PURPLE)  # the resume line
    assert _has_colour(out / "throughput.png", RED) and _has_colour(out / "throughput.png", PURPLE)


def test_report_of_a_clean_run_marks_nothing(tmp_path):
    run_dir = tmp_path / "run"
    _fake_run(run_dir, with_restart=False)
    out = write_report(run_dir, tmp_path / "elsewhere")
    assert "no failures, restarts or preemptions" in (out / "report.md").read_text()
    assert not _has_colour(out / "loss.png", PURPLE) and not _has_colour(out / "throughput.png", RED)


def test_report_errors_say_what_to_give(tmp_path):
    with pytest.raises(ConfigError, match="has no metrics.jsonl: give a run directory written by toolkit train"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ConfigError, match="holds no training step yet"):
        write_report(tmp_path)


def test_report_cli(tmp_path):
    run_dir = tmp_path / "run"
    _fake_run(run_dir)
    proc = run_cli(["report", str(run_dir)])
    assert f"report written to {run_dir}/report/report.md" in proc.stdout
    bad = run_in_process(["report", str(tmp_path / "nope")], check=False)
    assert bad.returncode == 2 and "has no metrics.jsonl" in bad.stderr


def test_mixture_of_experts_runs_get_expert_plot_and_summary(tmp_path):
    run_dir = tmp_path / "moe"
    run_dir.mkdir()
    rows = [{"step": s, "loss": 5.0 - s / 10, "lr": 1e-3, "grad_norm": 1.0, "tokens": 256, "tokens_per_s": 1000.0,
             "step_s": 0.2, "elapsed_s": 0.2 * s, "time": T0 + s, "moe_aux_loss": 2.2 - s / 100,
             "moe_load_max": 1.6 - s / 100, "moe_expert_tokens": [[200 - s, 100, 100, 112 + s], [128, 128, 128, 128]]}
            for s in range(1, 11)]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (run_dir / "config.yaml").write_text("backend: megatron\nnproc: 2\nmodel: {name_or_path: /m/mixtral, dtype: fp32}\n"
                                         "megatron: {tp: 1, pp: 1, ep: 2}\n")
    out = write_report(run_dir)
    text = (out / "report.md").read_text()
    assert (out / "experts.png").stat().st_size > 10_000 and "![experts](experts.png)" in text
    assert "tp=1 pp=1 ep=2" in text
    assert "- experts: load-balancing loss 2.1900 -> 2.1000; busiest expert at 1.59x an even load" in text
    assert "busiest/idlest per layer at step 10: 1.48x/0.78x, 1.00x/1.00x" in text  # 190 / 128, 100 / 128


def test_packed_runs_report_efficiency_documents_per_row_and_overflow(tmp_path):
    from toolkit.observe.report import read_run, summary
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"event": "packing", "packing": "documents", "documents": 100, "train_rows": 30,
              "overflow_documents": 3, "overflow": "split"}]
    lines += [{"step": s, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens": 512, "tokens_per_s": 1000.0,
               "step_s": 0.5, "elapsed_s": s * 0.5, "time": T0 + s, "packing_efficiency": e, "documents_per_row": d}
              for s, e, d in [(1, 0.9, 3.0), (2, 0.8, 4.0)]]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in lines) + "\n")
    text = summary(read_run(run_dir), run_dir, [])
    assert ("- packing documents: 85.0% of row tokens are document tokens (packing efficiency), 3.50 documents "
            "per row; 3 documents longer than data.seq_len (split)") in text


# --- reports of real runs: every packing mode, both backends ----------------------------------------

REAL_RUNS = {"deepspeed-concat": ["backend=deepspeed", "zero.stage=1", "data.packing=concat"],
             "megatron-documents": ["backend=megatron", "data.packing=documents"],
             "deepspeed-pad": ["backend=deepspeed", "zero.stage=1", "data.packing=pad"],
             "megatron-concat": ["backend=megatron", "data.packing=concat"]}
"""A covering set: each packing mode and each backend, and concat (the default for plain text, the
demo's: its report raised KeyError 'documents_per_row') on both."""
DOCUMENTS = 48


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory, data_cache):
    """2-step one-rank runs on short instruction documents (several fit a row of 64 tokens)."""
    from tests.helpers.runs import train
    root = tmp_path_factory.mktemp("report_runs")
    data = root / "docs.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Count to {n}:", "response": " ".join(map(str, range(n % 7 + 1)))})
                            + "\n" for n in range(DOCUMENTS)))
    base = ["data.seq_len=64", "train.steps=2", "train.global_batch_size=4", "train.micro_batch_size=2",
            "train.warmup_steps=0", "train.eval_every=0", "train.log_every=1", "checkpoint.every=100",
            "train.export_hf=false", "data.eval_fraction=0", "data.format=json", "data.template=instruction",
            f"data.path={data}"]
    for name, overrides in REAL_RUNS.items():
        train(root / name, data_cache, *base, *overrides, nproc=1, base=[])
    return root


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REAL_RUNS))
def test_report_of_a_real_run_of_each_packing_mode_and_backend(name, real_runs):
    backend, packing = name.split("-")
    run_dir = real_runs / name
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    [event] = [r for r in rows if r.get("event") == "packing"]
    proc = run_in_process(["report", str(run_dir)])
    assert f"report written to {run_dir}/report/report.md" in proc.stdout
    md = (run_dir / "report" / "report.md").read_text()
    layout = "ZeRO-1" if backend == "deepspeed" else "tp=1 pp=1"
    assert f"- backend {backend} ({layout}), 1 rank(s) per node" in md and "- steps logged: 2 (last 2 of 2)" in md
    efficiency = 100 * sum(r["packing_efficiency"] for r in steps) / len(steps)
    line = f"- packing {packing}: {efficiency:.1f}% of row tokens are document tokens (packing efficiency), "
    if packing == "concat":  # rows cut from one stream: 100% document tokens, no per-row count
        assert efficiency == 100.0 and "documents_per_row" not in steps[0]
        assert line + f"{DOCUMENTS} documents concatenated into {event['train_rows']} rows" in md, md
    else:
        per_row = sum(r["documents_per_row"] for r in steps) / len(steps)
        assert per_row == 1.0 if packing == "pad" else per_row > 1.5  # a padded row holds one document
        assert line + f"{per_row:.2f} documents per row" in md, md

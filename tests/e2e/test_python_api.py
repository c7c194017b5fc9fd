"""The Python API (toolkit/__init__.py): the functions the CLI runs, importable without loading a
backend, and examples/python_api/finetune.py training through it on 2 launched ranks and on one
rank in its own process."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

import toolkit
from tests.helpers.runs import REPO, TINY, losses, run_in_process
from toolkit.config import ConfigError, load_config

EXAMPLE = REPO / "examples" / "python_api" / "finetune.py"


def test_import_toolkit_loads_no_backend_nor_torch():
    """``import toolkit`` loads no toolkit module but itself (each export is imported on first use)."""
    code = ("import json, sys, toolkit; toolkit.__all__; print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'deepspeed', 'megatron', 'transformers') or m.startswith('toolkit.'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_the_api_and_the_cli_call_the_same_train_and_convert(monkeypatch, tmp_path):
    """``toolkit.train`` / ``toolkit.convert`` and ``toolkit train`` / ``toolkit convert`` reach one
    function each (replaced here by a recorder, so nothing runs)."""
    import toolkit.convert
    import toolkit.run
    from toolkit.cli import main
    calls = []
    summary = {"from": "hf", "to": "zero", "tensors": 0, "step": None, "optimizer_state": False, "reader": "torch",
               "seconds": 0.0}
    monkeypatch.setattr(toolkit.run, "train", lambda run, **kw: calls.append(("train", run.run_dir, kw)) or 0)
    monkeypatch.setattr(toolkit.convert, "convert", lambda src, dst, **kw: calls.append(("convert", src, dst)) or summary)
    nodes = {"nnodes": 1, "min_nnodes": None, "node_rank": 0, "rdzv_endpoint": None, "dry_run": False}
    assert main(["train", "--run-dir", str(tmp_path)]) == 0
    assert toolkit.train(load_config(None, [f"run_dir={tmp_path}"]), **nodes) == 0
    assert calls == [("train", str(tmp_path), nodes)] * 2
    calls.clear()
    assert main(["convert", "src", "dst"]) == 0
    assert toolkit.convert("src", "dst") == summary
    assert calls == [("convert", "src", "dst")] * 2


def test_exports_are_the_cli_s_own_functions():
    import toolkit.cli
    import toolkit.convert
    import toolkit.plan
    import toolkit.run
    import toolkit.train.trainer
    import toolkit.train.worker
    assert toolkit.load_config is toolkit.cli.load_config
    assert toolkit.build_plan is toolkit.plan.build_plan  # what toolkit.run.train plans with
    assert toolkit.build_engine is toolkit.train.worker.build_engine  # what each rank's run_worker calls
    assert toolkit.Trainer is toolkit.train.trainer.Trainer
    assert toolkit.inspect is toolkit.convert.inspect  # what cmd_inspect calls
    import inspect
    assert inspect.signature(toolkit.train) == inspect.signature(toolkit.run.train)
    assert list(inspect.signature(toolkit.convert).parameters)[:3] == ["src", "dst", "to"]


def test_train_refuses_a_plan_made_for_another_world_size(tmp_path):
    cfg = load_config(None, [f"run_dir={tmp_path}", "nproc=2"])
    with pytest.raises(ConfigError, match=r"this job has 2 ranks, but its plan was made for \[1\]"):
        toolkit.train(toolkit.build_plan(cfg, [1]))
    assert not (tmp_path / "plan.json").exists()


def _example(run_dir, data_cache, *args: str) -> subprocess.CompletedProcess:
    sets = [a for s in [*TINY, f"data.cache_dir={data_cache}"] for a in ("--set", s)]
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--run-dir", str(run_dir), "--steps", "6", *sets, *args],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def launched(tmp_path_factory, data_cache):
    """The example as written: ``toolkit.train`` starts the demo's 2 ranks."""
    run_dir = tmp_path_factory.mktemp("python_api") / "run"
    _example(run_dir, data_cache)
    return run_dir


@pytest.mark.slow
def test_example_trains_on_two_launched_ranks_and_converts(launched):
    assert len(losses(launched)) == 6 and all(math.isfinite(x) for x in losses(launched))
    assert (launched / "hf_final" / "config.json").is_file()
    info = toolkit.inspect(launched / "zero")
    assert info["format"].startswith("zero")
    printed = run_in_process(["inspect", "--json", str(launched / "zero")]).stdout
    assert json.loads(printed) == json.loads(json.dumps(info))  # the API's answer is the command's


@pytest.mark.slow
def test_example_trains_one_rank_in_process_as_the_launched_ranks_do(launched, tmp_path, data_cache):
    """``build_engine`` + ``Trainer`` in the example's own process (DP=1) against the 2 launched
    ranks: the same global batches, so the same losses (measured here: identical to the last bit)."""
    proc = _example(tmp_path / "run", data_cache, "--in-process")
    assert "on 1 rank(s)" in proc.stdout and "toolkit: done" not in proc.stdout  # no launcher ran
    assert losses(tmp_path / "run") == pytest.approx(losses(launched), rel=1e-6)
    assert (tmp_path / "run" / "hf_final" / "config.json").is_file()

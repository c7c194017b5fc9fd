"""The GPU check rehearsed on the CPU (``benchmarks/gpu_check.py``), so a harness bug cannot waste the
few minutes of a GPU machine: the plan fits the budget and the budget the command limit; process
sessions and hard timeouts (a hanging phase and the child it started in a session of its own are
both gone), results.json and summary.md after every phase (a run killed from outside keeps them),
the PASS/FAIL table and the exit code; a test phase stopped at its time reports what finished; the
checks that replaced ones which could not fail, each shown failing on a wrong input; the whole script
end to end (slow); the carried wheels installed offline into a CPython 3.12 (slow, needs ``.whl/``
and pyenv's 3.12)."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from benchmarks import gpu_check
from benchmarks.gpu_check import FAIL, PASS, SKIP

REPO = Path(__file__).resolve().parents[2]


def _alive(pid: int) -> bool:
    st = gpu_check._stat(pid)
    return st is not None and st[0] != "Z"


def test_a_hanging_phase_and_its_escaped_child_are_killed(tmp_path):
    """The HANG stand-in ignores SIGTERM and starts a grandchild in a new session (as torch elastic's
    ranks may be) that ignores it too: ``stop`` ends both (SIGKILL after the grace), found by token."""
    s = gpu_check.Session([sys.executable, "-c", gpu_check.HANG], tmp_path / "hang.log", dict(os.environ))
    deadline = time.monotonic() + 30
    while len(gpu_check.tagged(s.token)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = gpu_check.tagged(s.token)
    assert len(pids) == 2, pids  # the phase and its grandchild
    assert s.wait(0.5) is None  # still running: the timeout path
    assert s.stop(grace=1.0) == []
    assert not any(_alive(p) for p in pids)


def _tiny_wheel(folder: Path) -> Path:
    """A pure-Python wheel (module ``gpu_check_probe``) built by hand, for the offline install."""
    name = "gpu_check_probe-1.0-py3-none-any.whl"
    files = {"gpu_check_probe.py": b"VALUE = 42\n",
             "gpu_check_probe-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: gpu-check-probe\nVersion: 1.0\n",
             "gpu_check_probe-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                    b"Tag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},"
                     f"{len(b)}\n" for n, b in files.items()) + "gpu_check_probe-1.0.dist-info/RECORD,,\n"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / name, "w") as z:
        for n, b in {**files, "gpu_check_probe-1.0.dist-info/RECORD": record.encode()}.items():
            z.writestr(n, b)
    return folder / name


def _run_check(tmp_path: Path, *extra: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict, str]:
    out, work = tmp_path / "out", tmp_path / "work"
    _tiny_wheel(tmp_path / "wheels")
    proc = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "--out", str(out), "--work", str(work),
                           "--rehearse", "--wheels", str(tmp_path / "wheels"), *extra],
                          cwd=REPO, capture_output=True, text=True, timeout=3000, env={**os.environ, **(env or {})})
    results = json.loads((out / "results.json").read_text())
    return proc, results, (out / "summary.md").read_text()


def test_rehearsal_harness_passes_skips_and_fails_with_the_right_exit_code(tmp_path):
    """One run: the wheels install offline into WORK/site, a stand-in FusedAdam build runs in the
    background from t=0, ``environment`` runs in its child (SKIP for the GPU row on a CPU), and
    ``matmul_peak`` hangs and is killed at its timeout: the table says FAIL, the exit code is 1, no
    tagged process is left, and OUT holds the three files only."""
    proc, results, summary = _run_check(tmp_path, "--only", "environment", "matmul_peak", "--inject-hang",
                                        "matmul_peak", "--timeouts", "matmul_peak=3",
                                        "--fused-adam-cmd", "echo FUSED_ADAM_OK")
    phases = results["phases"]
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(phases) == ["wheels", "environment", "matmul_peak", "fused_adam"]
    assert phases["wheels"]["status"] == "ok" and (tmp_path / "work" / "site" / "gpu_check_probe.py").exists()
    env_rows = {r["check"]: r["status"] for r in phases["environment"]["checks"]}
    assert env_rows == {"CUDA device visible to torch": SKIP}
    assert phases["environment"]["info"]["torch"]
    hung = phases["matmul_peak"]
    assert hung["status"] == "timeout" and hung["left_behind"] == [] and hung["seconds"] < 30
    assert phases["fused_adam"]["checks"][0]["status"] == PASS
    assert results["verdict"] == FAIL and "| matmul_peak | (phase) | FAIL | timeout |" in summary
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["logs.tar.gz", "results.json", "summary.md"]
    log = subprocess.run(["tar", "-xOzf", str(tmp_path / "out" / "logs.tar.gz"), "logs/matmul_peak.log"],
                         capture_output=True, text=True).stdout
    assert "hanging" in log


def test_a_phase_that_must_finish_aborts_the_rest_and_a_failed_build_is_the_fallback(tmp_path):
    """``environment`` times out: every later phase is recorded "not run" with the reason, none starts.
    The FusedAdam build fails: a PASS saying so (the toolkit falls back to torch's AdamW by design)."""
    proc, results, summary = _run_check(tmp_path, "--only", "environment", "matmul_peak", "--inject-hang",
                                        "environment", "--timeouts", "environment=2",
                                        "--fused-adam-cmd", "echo no nvcc here; exit 1")
    phases = results["phases"]
    assert proc.returncode == 1 and phases["environment"]["status"] == "timeout"
    assert phases["matmul_peak"] == {"status": "not run", "why": phases["matmul_peak"]["why"]}
    assert phases["matmul_peak"]["why"].startswith("aborted: environment failed (killed after 2 s")
    build = phases["fused_adam"]["checks"][0]
    assert build["status"] == PASS and build["why"].startswith("not built (exit 1)"), build


def test_summary_and_results_survive_a_kill_from_outside(tmp_path):
    """The GPU machine stops a command at its limit: whatever phases ended before are in summary.md and
    results.json already (both rewritten after every phase, not only at the end)."""
    out, work = tmp_path / "out", tmp_path / "work"
    proc = subprocess.Popen([sys.executable, "benchmarks/gpu_check.py", "--out", str(out), "--work", str(work),
                             "--rehearse", "--wheels", str(tmp_path / "none"), "--no-fused-adam", "--only",
                             "environment", "matmul_peak", "--inject-hang", "matmul_peak"],
                            cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    def environment_recorded() -> bool:
        return (out / "summary.md").exists() and "| environment |" in (out / "summary.md").read_text(errors="ignore")
    deadline = time.monotonic() + 120
    while not environment_recorded() and time.monotonic() < deadline:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)  # the parent, its phase and the phase's children
    proc.wait()
    summary = (out / "summary.md").read_text()
    assert "| environment | CUDA device visible to torch | SKIP |" in summary
    assert "running (the phases so far)" in summary
    assert "environment" in json.loads((out / "results.json").read_text())["phases"]


def test_a_process_left_on_the_gpu_fails_the_phase(tmp_path):
    """A stand-in ``nvidia-smi`` that always lists a compute process: the phase that just ended is an
    error naming it (the next phase would share the GPU with it), and the run fails."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho '4242, 1234'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    proc, results, _ = _run_check(tmp_path, "--only", "environment", "--no-fused-adam", "--gpu-clear-wait-s", "1",
                                  env={"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"})
    entry = results["phases"]["environment"]
    assert proc.returncode == 1 and entry["status"] == "error"
    assert entry["why"] == "still on the GPU after the phase: [{'pid': 4242, 'mib': 1234.0}]"


def test_verdict_passes_with_skips_and_fails_on_any_failure_or_unfinished_phase():
    ok = {"status": "ok", "checks": [gpu_check.check("a", True), gpu_check.check("b", None, why="1 GPU")]}
    assert gpu_check.verdict({"phases": {"x": ok}}) == PASS
    assert gpu_check.verdict({"phases": {"x": ok, "y": {"status": "ok", "checks": [gpu_check.check("c", False)]}}}) == FAIL
    assert gpu_check.verdict({"phases": {"x": ok, "y": {"status": "not run", "why": "no time left"}}}) == FAIL
    row = gpu_check.check("max |a - b|", False, measured={"max |a - b|": 0.5}, bound=0.1, why="two\nlines")
    text = gpu_check.table({"verdict": FAIL, "mode": "test", "phases": {"x": {"status": "ok", "checks": [row]}}})
    assert "| x | max \\|a - b\\| | FAIL | max \\|a - b\\|: 0.5 | 0.1 | two lines |" in text  # one table row


# --- checks that can fail -------------------------------------------------------------------------

def _fixed(rows: list[dict]) -> dict[str, str]:
    return {r["check"]: r["status"] for r in rows}


def test_fixed_batch_check_fails_on_disagreement_uniform_logits_or_infinite_loss():
    v, bound = 2048, gpu_check.FIXED_BOUND
    good = gpu_check.fixed_batch_checks({"deepspeed": 8.31, "megatron": 8.31 * (1 + 1e-7)}, v, bound)
    assert set(_fixed(good).values()) == {PASS}
    assert _fixed(gpu_check.fixed_batch_checks({"deepspeed": 8.31, "megatron": 8.31 * (1 + 4e-4)}, v, bound))[
        "both backends' loss on one fixed batch (rel)"] == FAIL
    uniform = gpu_check.fixed_batch_checks({"deepspeed": 7.65, "megatron": 7.65}, v, bound)  # ln 2048 = 7.62
    assert _fixed(uniform)["logits far from uniform: |loss - ln V| / ln V"] == FAIL
    inf = gpu_check.fixed_batch_checks({"deepspeed": float("inf"), "megatron": float("inf")}, v, bound)
    assert _fixed(inf)["deepspeed step-1 loss finite"] == FAIL and FAIL in _fixed(inf).values()
    nan = gpu_check.fixed_batch_checks({"deepspeed": float("nan"), "megatron": 9.9}, v, bound)
    assert _fixed(nan)["both backends' loss on one fixed batch"] == FAIL


def _scale_rows(scales: list[float], skipped: set[int]) -> dict[int, dict]:
    return {s: {"loss_scale": x, "skipped": s in skipped} for s, x in enumerate(scales, start=1)}


def test_loss_scale_checks_follow_the_scalers_and_refuse_a_constant_reader():
    from tests.helpers.gpu import check_scales, deepspeed_scales, megatron_scales
    overflows = [s in (5, 6) for s in range(1, 11)]
    ds = deepspeed_scales(overflows, initial=2.0**16)
    assert ds == [2.0**16] * 5 + [2.0**15] * 5  # hysteresis 2: the second overflow in a row halves
    assert megatron_scales(overflows, initial=2.0**16) == ds
    check_scales(_scale_rows(ds, {5, 6}), deepspeed_scales)
    with pytest.raises(AssertionError):
        check_scales(_scale_rows([2.0**16] * 10, {5, 6}), deepspeed_scales)  # the old `<=` passed this
    with pytest.raises(AssertionError):  # megatron at 2^32: its early skips must halve it too
        check_scales(_scale_rows([2.0**32] * 4, {1, 2, 3}), megatron_scales)
    check_scales(_scale_rows([2.0**32, 2.0**31, 2.0**30, 2.0**30], {1, 2, 3}), megatron_scales)


class _Rows:
    def __init__(self):
        self.checks = []

    def add(self, *a, **k):
        self.checks.append(gpu_check.check(*a, **k))


def test_optimizer_and_host_sync_rows_read_what_the_runs_record():
    """The DeepSpeed run's ``optimizer`` event (FusedAdam, or torch's AdamW after a failed build, with
    the reason) passes, its absence fails; ``host_syncs`` that grow from one step to the next fail."""
    rows = _Rows()
    fallback = {"optimizer": "torch.optim.AdamW(fused=True)", "fallback_reason": "FusedAdam did not load"}
    gpu_check.optimizer_check(rows, {"event:optimizer": fallback}, "deepspeed")
    gpu_check.optimizer_check(rows, {"optimizer_steps": 3}, "deepspeed")
    gpu_check.host_sync_check(rows, [{"host_syncs": n} for n in (9, 4, 4, 4)], "megatron")
    gpu_check.host_sync_check(rows, [{"host_syncs": n} for n in (4, 4, 5)], "megatron")
    assert [r["status"] for r in rows.checks] == [PASS, FAIL, PASS, FAIL]
    assert rows.checks[0]["why"] == "FusedAdam did not load"


def test_router_check_recomputes_the_load_and_refuses_constants():
    from tests.helpers.gpu import check_router_stats
    counts = [[700, 600, 400, 348], [512, 512, 512, 512]]
    row = {"moe_expert_tokens": counts, "moe_load_max": round(700 / 512, 4), "moe_aux_loss": 0.01}
    check_router_stats({1: row}, tokens=1024, top_k=2, layers=2)
    with pytest.raises(AssertionError):  # the old `>= 1.0` passed a reader that always said 1.0
        check_router_stats({1: {**row, "moe_load_max": 1.0}}, tokens=1024, top_k=2, layers=2)
    with pytest.raises(AssertionError):  # tokens lost on the way
        check_router_stats({1: {**row, "moe_expert_tokens": [[1, 1, 1, 1]] * 2}}, tokens=1024, top_k=2, layers=2)


def test_expected_kernel_is_flex_for_masks_and_softcaps():
    from tests.helpers.attention import CASES
    from tests.helpers.gpu import expected_kernel
    from toolkit.adapters.attention import choose_kernel
    kernels = {case: expected_kernel(case) for case in CASES}
    assert "flex" in kernels.values()
    for case, kernel in kernels.items():
        docs, window, softcap = CASES[case]
        assert choose_kernel("auto", "cuda", masked=docs is not None or window is not None,
                             softcap=softcap is not None, dropout=False) == kernel, case


def test_throughput_model_fits_the_sequence_and_its_flops_are_counted_twice_alike():
    """The check counts model FLOPs from the HF config with its own formula; the toolkit's
    (``estimate/flops.py``, what ``toolkit train`` logs MFU with) is another count: they agree."""
    from transformers import AutoConfig

    from toolkit.estimate.flops import flops_per_token
    from toolkit.plan.model import model_spec
    assert gpu_check.LLAMA_1B["max_position_embeddings"] >= gpu_check.GPU.seq_len  # was 2048 < 4096
    fpt = gpu_check.llama_flops_per_token(gpu_check.LLAMA_1B, 4096)
    assert 6 * 0.9e9 < fpt < 6 * 1.3e9 + 12 * 22 * 2048 * 4096  # ~1.1B parameters
    fields = {k: v for k, v in gpu_check.LLAMA_1B.items() if k not in ("architectures", "model_type")}
    theirs = flops_per_token(model_spec(AutoConfig.for_model("llama", **fields)), 4096)
    assert fpt == pytest.approx(theirs, rel=1e-9)


# --- feasible by construction -----------------------------------------------------------------------

def test_the_plan_fits_the_budget_and_the_budget_the_command_limit():
    """On one GPU: the wheels' install, every default phase's timeout and the FusedAdam wait add up to
    no more than the default budget, and the budget leaves the 600 s command limit room to stop the
    last phase (SIGTERM grace 10 s, SIGKILL 5 s, the GPU cleared 15 s) and write the summary."""
    planned = gpu_check.planned_seconds(gpu_check.default_phases())
    print(f"\nplanned {planned} s of a {gpu_check.DEFAULT_BUDGET_S} s budget")
    assert planned <= gpu_check.DEFAULT_BUDGET_S <= 540
    assert gpu_check.COMMAND_LIMIT_S - gpu_check.DEFAULT_BUDGET_S >= 10 + 5 + 15 + 10
    order = [p.name for p in gpu_check.default_phases()]
    assert order[:7] == ["environment", "preflight", "matmul_peak", "throughput_hf", "fixed_batch",
                         "throughput_deepspeed", "throughput_megatron"]  # what the verdict needs, first
    assert [p.name for p in gpu_check.PHASES if p.aborts] == ["environment", "preflight"]
    files = {f for files, _ in gpu_check.TEST_SETS.values() for f in files}
    assert files == {str(f.relative_to(REPO)) for f in (REPO / "tests" / "gpu").glob("test_*.py")}


def test_a_stopped_test_phase_reports_what_finished_and_what_did_not(tmp_path):
    """The results stream (tests/gpu/conftest.py) as xdist's controller and worker both write it: one
    row per collected test, a failure beats the same test's pass, and a test with no outcome when
    the phase stopped it FAILs as not finished."""
    stream = tmp_path / "results.jsonl"
    lines = [{"collected": ["tests/gpu/a.py::test_ok", "tests/gpu/a.py::test_bad", "tests/gpu/a.py::test_slow"]},
             {"collected": ["tests/gpu/a.py::test_ok"]},
             {"test": "tests/gpu/a.py::test_ok", "when": "call", "outcome": "passed", "message": ""},
             {"test": "tests/gpu/a.py::test_ok", "when": "call", "outcome": "passed", "message": ""},
             {"test": "tests/gpu/a.py::test_bad", "when": "call", "outcome": "passed", "message": ""},
             {"test": "tests/gpu/a.py::test_bad", "when": "teardown", "outcome": "failed", "message": "E  boom"}]
    stream.write_text("".join(json.dumps(x) + "\n" for x in lines))
    collected, outcomes = gpu_check.read_test_results(stream)
    values = [{"test": "test_ok", "name": "gap", "measured": 1e-6, "bound": 1e-5}]
    rows = {r["check"]: r for r in gpu_check.test_rows(collected, outcomes, values, stopped=True, rerun="--only x")}
    assert [r["status"] for r in rows.values()] == [PASS, FAIL, FAIL]
    assert rows["a.py::test_ok"]["measured"] == {"gap": 1e-6} and rows["a.py::test_ok"]["bound"] == {"gap": 1e-5}
    assert rows["a.py::test_bad"]["why"] == "teardown: E  boom"
    assert rows["a.py::test_slow"]["why"] == "did not finish before the phase's time ran out (rerun: --only x)"


def test_matmul_peak_must_sit_within_the_spec_sheet():
    """The old check passed any positive rate; now 0.3x-1.1x of the spec sheet (an H100 measured
    769-798 TFLOP/s of 989), SKIP with the reason where no spec is known (a CPU)."""
    status = {tflops: gpu_check.matmul_checks(tflops, "NVIDIA H100 80GB HBM3")[0]["status"]
              for tflops in (780.0, 250.0, 1200.0)}
    assert status == {780.0: PASS, 250.0: FAIL, 1200.0: FAIL}
    assert gpu_check.matmul_checks(780.0, "NVIDIA H200")[0]["status"] == PASS
    assert gpu_check.matmul_checks(0.05, None)[0]["status"] == SKIP


def test_mfu_is_recomputed_and_the_logged_one_must_agree():
    """MFU from wall-clock steps and the check's own FLOP count, against the spec peak (5%-100%) and the
    matmul peak measured minutes before; the toolkit's logged MFU within 10% of it."""
    fpt, h100 = gpu_check.llama_flops_per_token(gpu_check.LLAMA_1B, 4096), "NVIDIA H100 80GB HBM3"
    tokens = 0.4 * 989e12 / fpt  # 40% MFU
    info, rows = gpu_check.mfu_checks(tokens, fpt, h100, measured_peak=780e12, logged_mfu=0.41)
    assert info["mfu_spec"] == pytest.approx(0.4) and [r["status"] for r in rows] == [PASS, PASS, PASS]
    _, rows = gpu_check.mfu_checks(tokens, fpt, h100, measured_peak=780e12, logged_mfu=0.2)  # a wrong formula
    assert rows[2]["status"] == FAIL
    _, rows = gpu_check.mfu_checks(tokens * 3, fpt, h100, measured_peak=780e12)  # faster than the hardware
    assert [r["status"] for r in rows] == [FAIL, FAIL]
    _, rows = gpu_check.mfu_checks(tokens / 20, fpt, h100, measured_peak=780e12)  # 2%: not training as it should
    assert rows[0]["status"] == FAIL
    assert gpu_check.mfu_checks(tokens, fpt, None, None)[1][0]["status"] == SKIP


def test_wall_clock_tokens_per_s_reads_the_row_stamps():
    rows = [{"time": 100.0}, {"time": 102.0}, {"time": 103.0}, {"time": 104.5}, {"time": 105.5}]
    assert gpu_check.wall_clock_tokens_per_s(rows, 1000, warmup=2) == pytest.approx(1000 / 1.0)  # steps 3-5
    assert gpu_check.wall_clock_tokens_per_s(rows, 1000, warmup=1) == pytest.approx(1000 / 1.25)
    assert gpu_check.wall_clock_tokens_per_s(rows[:1], 1000, warmup=1) is None


def test_the_baselines_language_is_learnable_and_held_out_rows_are_new():
    import torch
    train, held = gpu_check.synthetic_rows(64, 8, 16, seed=0), gpu_check.synthetic_rows(64, 2, 16, seed=1)
    successor = {}
    for row in torch.cat([train, held]).tolist():
        for a, b in zip(row, row[1:]):
            assert successor.setdefault(a, b) == b  # one rule for every row
    assert not any(torch.equal(h, r) for h in held for r in train)


# --- slow: the whole rehearsal, the perturbation, the offline install -------------------------------

@pytest.mark.slow
def test_fixed_batch_catches_a_perturbed_backend(tmp_path):
    """Through ``toolkit train`` on both backends (one rank, fp32): with the wide init the check passes
    unperturbed and fails when megatron's copy has layer 1's attention switched off (its output
    projection zeroed). Measured here: clean 8.24666 both (rel 0); off: 8.24666 vs 8.25963 (1.6e-3,
    79x the bound). (Why the wide init: at HF's 0.02, near-uniform logits, the same change gave
    7.62224 vs 7.61998, 3.0e-4, far inside the old step-1 check's 2%; shown by this test until 2026-12-06.)"""
    (tmp_path / "logs").mkdir()
    clean = gpu_check.fixed_batch_losses(tmp_path, 32)
    perturbed = gpu_check.fixed_batch_losses(tmp_path, 32, perturb={"megatron": -1.0})
    print(f"\nclean {clean}\nperturbed {perturbed}")
    assert set(_fixed(gpu_check.fixed_batch_checks(clean, 2048, gpu_check.FIXED_BOUND)).values()) == {PASS}
    assert _fixed(gpu_check.fixed_batch_checks(perturbed, 2048, gpu_check.FIXED_BOUND))[
        "both backends' loss on one fixed batch (rel)"] == FAIL


@pytest.mark.slow
def test_whole_rehearsal_runs_every_phase(tmp_path):
    """``gpu_check.py --rehearse``: every phase runs to its end on the CPU (a check inside may fail on
    a defect of the toolkit; the harness may not), results.json holds them all, the exit code is the
    verdict's."""
    proc, results, summary = _run_check(tmp_path, "--budget-s", "3000")
    phases = results["phases"]
    print(summary)
    assert set(phases) == {"wheels", "fused_adam", *(p.name for p in gpu_check.default_phases())}
    broken = {n: (e["status"], e.get("why"), e.get("log_tail", "")[-800:]) for n, e in phases.items() if e["status"] != "ok"}
    assert not broken, broken
    assert proc.returncode == (0 if results["verdict"] == PASS else 1)
    assert all(p["checks"] for n, p in phases.items()), [n for n, p in phases.items() if not p["checks"]]


PY312 = shutil.which("python3.12", path=os.path.expanduser("~/.pyenv/versions/3.12.1/bin")) or shutil.which("python3.12")


@pytest.mark.slow
@pytest.mark.skipif(not (REPO / ".whl").is_dir() or PY312 is None,
                    reason="needs .whl/ (gpu_wheels.py fetch) and a CPython 3.12 (pyenv)")
def test_carried_wheels_install_offline_into_python312(tmp_path):
    """The bundle installs into a real CPython 3.12 venv with ``--no-index``, and what needs nothing of
    the GPU machine's own packages imports there: pydantic with its compiled core and the carried
    typing-extensions (the machine's may be too old for it), hjson, rich."""
    subprocess.run([PY312, "-m", "venv", str(tmp_path / "venv")], check=True)
    py = str(tmp_path / "venv" / "bin" / "python")
    wheels = sorted(str(p) for p in (REPO / ".whl").glob("*.whl"))
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", *wheels], check=True)
    code = ("import pydantic, pydantic_core, typing_extensions, hjson, rich, annotated_types\n"
            "class M(pydantic.BaseModel):\n    x: int\n"
            "assert M(x='3').x == 3\nprint(pydantic.VERSION, pydantic_core.__version__)")
    out = subprocess.run([py, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    size = sum(p.stat().st_size for p in (REPO / ".whl").glob("*.whl"))
    print(f"\n{len(wheels)} wheels, {size / 2**20:.1f} MiB; {out.stdout.strip()}")
    assert size < 64 * 2**20

"""The package as a user gets it: the wheel built from this checkout, installed into a virtualenv of
its own, used from a folder outside the checkout (presets, the demo model and corpus, the version
matrix must come from the installed package, not from the source tree)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.helpers.runs import REPO

pytestmark = pytest.mark.slow
CLEAN = {**os.environ, "PYTHONPATH": ""}  # nothing from the checkout on the path


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A venv holding only the toolkit's wheel, over the test environment's packages (its
    dependencies; a .pth line, so the test environment's own editable toolkit stays out)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "src"  # a copy: the build writes build/ and *.egg-info beside the sources
    shutil.copytree(REPO / "toolkit", source / "toolkit", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(root / "dist"), str(source)], check=True, cwd=root, env=CLEAN)
    wheel = next((root / "dist").glob("hf_parallel_toolkit-*.whl"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, env=CLEAN)
    site = Path(subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True, env=CLEAN).stdout.strip())
    (site / "test_environment.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                   check=True, cwd=root, env=CLEAN)
    return venv


def toolkit(venv: Path, cwd: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**CLEAN, "PATH": f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    return subprocess.run([str(venv / "bin" / "toolkit"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_installed_wheel_is_what_runs(installed, tmp_path):
    probe = subprocess.run([str(installed / "bin" / "python"), "-c", "import toolkit; print(toolkit.__file__)"],
                           cwd=tmp_path, capture_output=True, text=True, check=True, env=CLEAN)
    assert probe.stdout.strip().startswith(str(installed)), probe.stdout  # not the checkout
    doctor = toolkit(installed, tmp_path, "doctor")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "zero3_offload" in doctor.stdout and "tp2_sp" in doctor.stdout and "demo          ok" in doctor.stdout


@pytest.mark.parametrize("sets", [[], ["zero.ds_config=zero2"], ["backend=megatron", "megatron.preset=tp2_sp"]])
def test_dry_runs_from_another_folder(installed, tmp_path, sets):
    args = ["train", "--dry-run"] + [a for s in sets for a in ("--set", s)]
    proc = toolkit(installed, tmp_path, *args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no process group was started" in proc.stdout


def test_demo_steps_from_another_folder(installed, tmp_path, data_cache):
    run = tmp_path / "run"
    proc = toolkit(installed, tmp_path, "train", "--run-dir", str(run), "--set", "train.steps=3", "--set",
                   "data.seq_len=32", "--set", "train.global_batch_size=8", "--set", "train.micro_batch_size=2",
                   "--set", "train.eval_every=0", "--set", f"data.cache_dir={data_cache}")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]
    assert (run / "plan.json").is_file() and (run / "hf_final" / "config.json").is_file()

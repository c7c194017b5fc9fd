"""Build docker/Dockerfile.cpu for real and run the toolkit inside it (podman, as root).

The recipe of ../shared/FIELD_NOTES.md: no Docker engine and no image registry here, so the base is
a minimal Debian made with debootstrap and imported into podman (standing in for the public
python:*-slim base), podman runs with runc and a containers.conf without default ulimits, pip in
the build reaches PyPI through the host's CA bundle, and the CPU torch wheel comes from the host's
wheel folder when it has one. `.ci/run` installs podman, runc and debootstrap.
"""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.container

BASE = "localhost/debian-py:bookworm"
IMAGE = "localhost/hf-parallel-toolkit:cpu-test"
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"


def _missing() -> str | None:
    if os.geteuid() != 0:
        return "needs root (podman with runc, debootstrap)"
    tools = [t for t in ("podman", "runc", "debootstrap") if shutil.which(t) is None]
    if tools:
        return f"{', '.join(tools)} not installed: apt-get install podman runc debootstrap (.ci/run does)"
    return None


@pytest.fixture(scope="module")
def podman(tmp_path_factory):
    """podman as the field notes run it: runc, and a containers.conf without default ulimits."""
    reason = _missing()
    if reason:
        if os.environ.get("CI") == "true":  # CI installs the tools; a skip there would hide a broken image
            pytest.fail(f"container test cannot run in CI: {reason}")
        pytest.skip(reason)
    conf = tmp_path_factory.mktemp("podman") / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def run(*args: str, timeout: float = 600, input: bytes | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", "--runtime", "runc", *args], env=env, capture_output=True,
                              timeout=timeout, input=input, check=False)
    return run


def _ok(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    assert proc.returncode == 0, f"{' '.join(map(str, proc.args))} exited {proc.returncode}\n{out[-6000:]}"
    return out


@pytest.fixture(scope="module")
def base_image(podman, tmp_path_factory) -> str:
    """A minimal Debian with python3 + venv, made once per machine (podman keeps it)."""
    if podman("image", "exists", BASE).returncode != 0:
        root = tmp_path_factory.mktemp("bookworm")
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                        "bookworm", str(root)], check=True, capture_output=True, timeout=900)
        tar = subprocess.run(["tar", "-C", str(root), "-c", "."], check=True, capture_output=True).stdout
        _ok(podman("import", "-", BASE, input=tar))
    return BASE


@pytest.fixture(scope="module")
def image(podman, base_image) -> str:
    args = ["build", "--network", "host", "-f", "docker/Dockerfile.cpu", "-t", IMAGE,
            "--build-arg", f"BASE_IMAGE={base_image}",
            "--build-arg", "PIP_CERT=/etc/ssl/certs/host-ca.crt", "--volume", f"{HOST_CA}:/etc/ssl/certs/host-ca.crt:ro"]
    wheels = os.environ.get("PIP_FIND_LINKS", "/opt/wheels")
    if glob.glob(f"{wheels}/torch-*.whl"):  # the CPU torch wheel on disk; else the CPU index is asked
        args += ["--build-arg", "PIP_FIND_LINKS=/wheels", "--volume", f"{wheels}:/wheels:ro"]
    _ok(podman(*args, str(REPO), timeout=1800))
    return IMAGE


def test_doctor_in_the_cpu_image(podman, image):
    out = _ok(podman("run", "--rm", "--network", "none", image))  # CMD: toolkit doctor
    assert "torch         2.13.0+cpu   (tested: 2.13.0)" in out and "warning" not in out and out.strip().endswith("ok")


def test_deepspeed_cpu_ops_are_prebuilt(podman, image):
    code = ("from deepspeed.git_version_info import installed_ops as o; "
            "print(sorted(k for k, v in o.items() if v))")
    out = _ok(podman("run", "--rm", "--network", "none", image, "python", "-c", code))
    assert "['deepspeed_shm_comm', 'fused_adam']" in out


def test_demo_trains_in_the_cpu_image(podman, image, tmp_path):
    tmp_path.chmod(0o777)  # the image's user (uid 1000) writes the run dir
    sets = ["train.steps=30", "train.eval_every=15", "checkpoint.every=30", "data.seq_len=64", "train.warmup_steps=5"]
    args = ["run", "--rm", "--network", "none", "--shm-size", "1g", "-v", f"{tmp_path}:/runs", image,
            "toolkit", "train", "--run-dir", "/runs/demo"]
    for s in sets:
        args += ["--set", s]
    _ok(podman(*args, timeout=900))
    lines = [json.loads(line) for line in (tmp_path / "demo" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in lines if "loss" in r]
    assert len(losses) == 30 and losses[-1] < losses[0] - 1.0, losses
    assert (tmp_path / "demo" / "hf_final" / "config.json").is_file()


def test_unit_tests_pass_in_the_cpu_image(podman, image):
    out = _ok(podman("run", "--rm", "--network", "none", "-w", "/opt/toolkit", image, "python", "-m", "pytest",
                     "-q", "-p", "no:cacheprovider", "tests/test_config.py", "tests/test_schedule.py",
                     "tests/test_packaging.py", timeout=600))
    assert " passed" in out and "failed" not in out

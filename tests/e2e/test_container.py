"""Build docker/Dockerfile.cpu for real and run the toolkit inside it (podman, as root).

How the image is built without a Docker engine: tests/helpers/container_image.py. `.ci/run` installs
podman, runc and debootstrap.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

from tests.helpers import container_image

pytestmark = pytest.mark.container


@pytest.fixture(scope="module")
def podman():
    reason = container_image.missing_tools()
    if reason:
        if os.environ.get("CI") == "true":  # CI installs the tools; a skip there would hide a broken image
            pytest.fail(f"container test cannot run in CI: {reason}")
        pytest.skip(reason)
    return container_image.podman


def _ok(proc) -> str:
    try:
        return container_image.checked(proc)
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="module")
def image(podman) -> str:
    try:
        return container_image.image_ready()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        pytest.fail(str(exc))


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
                     "-q", "-p", "no:cacheprovider", "tests/unit/test_config.py", "tests/unit/test_schedule.py",
                     "tests/unit/test_packaging.py", timeout=600))
    assert " passed" in out and "failed" not in out

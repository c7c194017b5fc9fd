"""The one version matrix (requirements/constraints.txt) is what setup.cfg admits and what the
images install; the Dockerfiles lint clean. Fast: no image is built here (see test_container.py)."""
from __future__ import annotations

import configparser
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.helpers.runs import REPO
from toolkit.observe.doctor import _norm, pinned_versions

DOCKER = REPO / "docker"
DOCKER_FILES = [DOCKER / "Dockerfile", DOCKER / "Dockerfile.cpu", DOCKER / "install.sh"]
PIN = re.compile(r"\b([A-Za-z0-9][A-Za-z0-9_.-]*)==([0-9][^\s\"';,\]]*)")


def pin_drift(text: str, pins: dict[str, str]) -> list[str]:
    """Every ``name==version`` written in ``text`` that disagrees with (or is missing from) the pins."""
    return [f"{name}=={version} (pinned: {pins.get(_norm(name), 'not pinned')})"
            for name, version in PIN.findall(text) if pins.get(_norm(name)) != version]


def setup_cfg_requirements() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    lines += [line for _, block in cfg["options.extras_require"].items() for line in block.splitlines()]
    return [Requirement(line) for line in lines if line.strip()]


def test_docker_files_pin_nothing_the_matrix_does_not():
    pins = pinned_versions()
    for path in DOCKER_FILES:
        assert pin_drift(path.read_text(), pins) == [], f"{path.name} drifts from requirements/constraints.txt"


def test_drift_check_catches_a_drifted_pin():
    pins = pinned_versions()
    assert pin_drift("pip install deepspeed==0.19.7 torch==2.13.0", pins) == ["deepspeed==0.19.7 (pinned: 0.19.8)"]
    assert pin_drift("pip install ninja==1.11", pins) == ["ninja==1.11 (pinned: not pinned)"]


def test_every_setup_cfg_requirement_is_pinned_within_its_range():
    pins = pinned_versions()
    for req in setup_cfg_requirements():
        assert _norm(req.name) in pins, f"setup.cfg needs {req.name} but requirements/constraints.txt does not pin it"
        pin = pins[_norm(req.name)]
        assert req.specifier.contains(pin), f"pin {req.name}=={pin} is outside setup.cfg's {req}"


def test_both_images_install_through_install_sh_with_the_pins():
    for name in ("Dockerfile", "Dockerfile.cpu"):
        text = (DOCKER / name).read_text()
        assert "docker/install.sh /opt/toolkit" in text, f"{name} must install through docker/install.sh"
        assert "PIP_CONSTRAINT=/opt/toolkit/requirements/constraints.txt" in text
        for arg in ("BASE_IMAGE", "PIP_CERT", "PIP_FIND_LINKS"):
            assert re.search(rf"^ARG {arg}\b", text, re.M), f"{name} lacks build arg {arg}"
        assert re.search(r"^USER 1000", text, re.M), f"{name} must run as a non-root user"


def _install_plan(**env) -> list[str]:
    """What install.sh would run (PIP=echo prints each pip command instead of running it)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "DS_BUILD_"))}
    proc = subprocess.run(["bash", str(DOCKER / "install.sh"), str(REPO), "test"], env={**full, "PIP": "echo", **env},
                          capture_output=True, text=True, check=True)
    return proc.stdout.splitlines()


def test_install_sh_installs_pinned_torch_first_then_the_toolkit_with_constraints():
    torch_pin = f"torch=={pinned_versions()['torch']}"
    cpu = _install_plan(TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu", PIP_CERT="")
    assert cpu[0].endswith(f"--index-url https://download.pytorch.org/whl/cpu {torch_pin}")
    assert cpu[1].endswith(f"-c {REPO}/requirements/constraints.txt -e {REPO}[test]") and len(cpu) == 2
    # A wheel folder (a proxy site's mirror, or /opt/wheels here) replaces the CPU index.
    local = _install_plan(TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu", PIP_FIND_LINKS="/opt/wheels")
    assert local[0] == f"install --no-cache-dir {torch_pin}"
    # Prebuilt DeepSpeed ops: DeepSpeed is built against the installed torch before the toolkit
    # would pull it in through an isolated build (which cannot see torch).
    gpu = _install_plan(DS_BUILD_FUSED_ADAM="1")
    assert gpu[0].endswith(torch_pin) and gpu[-1].endswith(f"-e {REPO}[test]")
    assert gpu[2] == f"install --no-cache-dir --no-build-isolation -c {REPO}/requirements/constraints.txt deepspeed"


def test_dockerfiles_lint_clean():
    # The venv's bin is not always on PATH (python -m pytest from outside an activated venv).
    hadolint = shutil.which("hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")
    if hadolint is None:
        missing = "hadolint is not installed: pip install -c requirements/constraints.txt -e '.[test]'"
        if os.environ.get("CI") == "true":  # the test extra installs it; a skip there would hide a lint failure
            pytest.fail(missing)
        pytest.skip(missing)
    for name in ("Dockerfile", "Dockerfile.cpu"):
        proc = subprocess.run([hadolint, str(DOCKER / name)], capture_output=True, text=True)
        assert proc.returncode == 0, f"hadolint {name}:\n{proc.stdout}{proc.stderr}"


def _install_sh_with(tmp_path: Path, torch_cuda: str, nvcc_release: str | None, **env) -> subprocess.CompletedProcess:
    """install.sh with stand-ins: a python whose torch reports CUDA ``torch_cuda`` ("" for a CPU
    build), an nvcc of ``nvcc_release`` (None: no CUDA toolkit), and a pip that prints its arguments
    and the DeepSpeed build variables it was started with."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    ds_env = "DS_ACCELERATOR=${DS_ACCELERATOR:-} DS_BUILD_FUSED_ADAM=${DS_BUILD_FUSED_ADAM:-}"
    scripts = {"python": f"#!/bin/bash\necho '{torch_cuda}'\n", "pip": f'#!/bin/bash\necho "pip $* | {ds_env}"\n'}
    if nvcc_release:
        scripts["nvcc"] = f"#!/bin/bash\necho 'Cuda compilation tools, release {nvcc_release}, V{nvcc_release}.88'\n"
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "DS_", "CUDA", "TORCH_"))}
    full = {**base, "PATH": f"{bin_dir}:/usr/bin:/bin", "CUDA_HOME": str(tmp_path / "no-cuda"),
            "PYTHON": str(bin_dir / "python"), "PIP": str(bin_dir / "pip"), **env}
    return subprocess.run(["bash", str(DOCKER / "install.sh"), str(REPO), "megatron"], env=full,
                          capture_output=True, text=True)


def test_gpu_image_build_fails_when_the_cpu_torch_was_installed(tmp_path):
    proc = _install_sh_with(tmp_path, torch_cuda="", nvcc_release=None, TORCH_BUILD="cuda", PIP_FIND_LINKS="/wheels")
    assert proc.returncode == 1 and "is a CPU build" in proc.stderr and "PIP_FIND_LINKS=/wheels" in proc.stderr
    ok = _install_sh_with(tmp_path, torch_cuda="13.0", nvcc_release=None, TORCH_BUILD="cuda")
    assert ok.returncode == 0 and "install.sh: torch==2.13.0, CUDA 13.0" in ok.stdout
    cpu_image = _install_sh_with(tmp_path, torch_cuda="13.0", nvcc_release=None, TORCH_BUILD="cpu")
    assert cpu_image.returncode == 1 and "is a CUDA 13.0 build" in cpu_image.stderr


@pytest.mark.parametrize("nvcc,prebuilt,why", [
    (None, False, "no CUDA toolkit (nvcc) in this image"),
    ("12.8", False, "nvcc is CUDA 12.8, torch's CUDA is 13.0 (another major version)"),
    ("13.1", True, "with "),
])
def test_gpu_image_prebuilds_fused_adam_only_with_an_nvcc_of_torchs_cuda(tmp_path, nvcc, prebuilt, why):
    proc = _install_sh_with(tmp_path, torch_cuda="13.0", nvcc_release=nvcc, CUDA_OPS="FUSED_ADAM")
    assert proc.returncode == 0, proc.stderr
    pips = [line for line in proc.stdout.splitlines() if line.startswith("pip ")]
    deepspeed_built = [line for line in pips if "--no-build-isolation" in line]
    assert why in proc.stdout
    if prebuilt:
        # DeepSpeed sees no GPU at build time: it must be told the accelerator, or it builds CPU ops.
        assert len(deepspeed_built) == 1 and deepspeed_built[0].endswith("DS_ACCELERATOR=cuda DS_BUILD_FUSED_ADAM=1")
    else:
        assert not deepspeed_built and "NOT prebuilding DeepSpeed's FUSED_ADAM" in proc.stdout
        assert "torch.optim.AdamW(fused=True)" in proc.stdout
    assert pips[-1].split(" | ")[0].endswith(f"-e {REPO}[megatron]")


def make_recipe(target: str) -> str:
    """The shell lines ``make -n TARGET`` would run, read from the Makefile (the CPU image, where this
    test also runs, has no make): the target's ``$(call NAME,ARGS)`` expanded with its define."""
    text = (REPO / "Makefile").read_text()
    call = re.search(rf"^{re.escape(target)}:.*\n\t\$\(call (\w+),([^)]*)\)", text, re.M)
    assert call, f"Makefile has no target {target} calling a define"
    body = re.search(rf"^define {call.group(1)}\n(.*?)^endef", text, re.M | re.S).group(1)
    for i, arg in enumerate(call.group(2).split(","), start=1):
        body = body.replace(f"$({i})", arg)
    return body.replace("$(PYTHON)", "python3")


@pytest.mark.parametrize("kind,dockerfile", [("gpu", "docker/Dockerfile"), ("cpu", "docker/Dockerfile.cpu")])
def test_make_image_targets_build_each_dockerfile(kind, dockerfile):
    """`make image-gpu` / `image-cpu` (docs/docker.md): docker where an engine answers, else the podman
    recipe this machine builds with; the GPU image is too large for CI, so only the target is checked."""
    plan = make_recipe(f"image-{kind}")
    assert f"docker build -f {dockerfile} -t hf-parallel-toolkit:{kind} ." in plan
    assert f"python3 -m tests.helpers.container_image --build {kind}" in plan
    from tests.helpers import container_image
    assert container_image.IMAGES[kind][0] == dockerfile

"""Build docker/Dockerfile.cpu with podman, the recipe of ../shared/FIELD_NOTES.md.

No Docker engine and no image registry here: the base is a minimal Debian made with debootstrap and
imported into podman (standing in for the public python:*-slim base), podman runs with runc and a
containers.conf without default ulimits, pip in the build reaches PyPI through the host's CA bundle,
and the CPU torch wheel comes from the host's wheel folder when it has one.

The build takes minutes and mostly waits on disk and unpacking, so ``tests/conftest.py`` starts it
in the background at collection (``python -m tests.container_image``, at the lowest CPU and I/O
priority) and runs the container tests last; their fixture waits for it, or builds inline when no
background build was started.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BASE = "localhost/debian-py:bookworm"
IMAGE = "localhost/hf-parallel-toolkit:cpu-test"
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
WORK = Path(tempfile.gettempdir()) / f"toolkit-container-build-{os.getuid()}"
_background: subprocess.Popen | None = None


def missing_tools() -> str | None:
    if os.geteuid() != 0:
        return "needs root (podman with runc, debootstrap)"
    tools = [t for t in ("podman", "runc", "debootstrap") if shutil.which(t) is None]
    if tools:
        return f"{', '.join(tools)} not installed: apt-get install podman runc debootstrap (.ci/run does)"
    return None


def podman(*args: str, timeout: float = 600, input: bytes | None = None) -> subprocess.CompletedProcess:
    """podman as the field notes run it: runc, and a containers.conf without default ulimits."""
    WORK.mkdir(exist_ok=True)
    conf = WORK / "containers.conf"
    conf.write_text("[containers]\ndefault_ulimits = []\n")
    return subprocess.run(["podman", "--runtime", "runc", *args], env={**os.environ, "CONTAINERS_CONF": str(conf)},
                          capture_output=True, timeout=timeout, input=input, check=False)


def checked(proc: subprocess.CompletedProcess) -> str:
    out = proc.stdout.decode(errors="replace") + proc.stderr.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, proc.args))} exited {proc.returncode}\n{out[-6000:]}")
    return out


def build_base() -> None:
    """A minimal Debian with python3 + venv, made once per machine (podman keeps it)."""
    if podman("image", "exists", BASE).returncode == 0:
        return
    root = Path(tempfile.mkdtemp(prefix="bookworm-", dir=WORK))
    try:
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv,ca-certificates",
                        "bookworm", str(root)], check=True, capture_output=True, timeout=900)
        tar = subprocess.run(["tar", "-C", str(root), "-c", "."], check=True, capture_output=True).stdout
        checked(podman("import", "-", BASE, input=tar))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def build_image() -> str:
    build_base()
    args = ["build", "--network", "host", "-f", "docker/Dockerfile.cpu", "-t", IMAGE,
            "--build-arg", f"BASE_IMAGE={BASE}",
            "--build-arg", "PIP_CERT=/etc/ssl/certs/host-ca.crt", "--volume", f"{HOST_CA}:/etc/ssl/certs/host-ca.crt:ro"]
    wheels = os.environ.get("PIP_FIND_LINKS", "/opt/wheels")
    if glob.glob(f"{wheels}/torch-*.whl"):  # the CPU torch wheel on disk; else the CPU index is asked
        args += ["--build-arg", "PIP_FIND_LINKS=/wheels", "--volume", f"{wheels}:/wheels:ro"]
    checked(podman(*args, str(REPO), timeout=1800))
    return IMAGE


def start_background_build() -> None:
    """Start the build now, niced, so it uses the cores the other tests leave idle."""
    global _background
    if _background is not None or missing_tools():
        return
    WORK.mkdir(exist_ok=True)
    log = open(WORK / "build.log", "wb")
    _background = subprocess.Popen(["nice", "-n", "19", "ionice", "-c", "3", sys.executable, "-m",
                                    "tests.container_image"], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # its own group: stopped whole, podman included


def stop_background_build() -> None:
    if _background is not None and _background.poll() is None:
        os.killpg(_background.pid, signal.SIGKILL)
        _background.wait()


def image_ready() -> str:
    """The built image: waits for the background build, or builds here when there was none."""
    if _background is None:
        return build_image()
    if _background.wait(timeout=2400) != 0:
        raise RuntimeError(f"background image build failed:\n{(WORK / 'build.log').read_text()[-6000:]}")
    return IMAGE


if __name__ == "__main__":
    try:
        print(build_image(), flush=True)
    except Exception as exc:  # the log is what the waiting fixture shows
        print(exc, flush=True)
        sys.exit(1)

"""Build docker/Dockerfile.cpu with podman, the recipe of ../shared/FIELD_NOTES.md.

No Docker engine and no image registry here: the base is a minimal Debian made with debootstrap and
imported into podman (standing in for the public python:*-slim base), podman runs with runc and a
containers.conf without default ulimits, pip in the build reaches PyPI through the host's CA bundle,
and the CPU torch wheel comes from the host's wheel folder when it has one.

The build takes minutes and mostly waits on disk and unpacking, so it runs in the background at the
lowest CPU and I/O priority (``python -m tests.helpers.container_image``), started by ``.ci/run``
before the set-up (``--detach``) or else by ``tests/conftest.py`` at collection, and the container
tests run last; their fixture waits for it, or builds inline when no background build was started. Under
pytest-xdist the controller starts it (workers are not its owners: the one that finishes first
would otherwise kill it) and the build reports to a status file.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BASE = "localhost/debian-py:bookworm"
IMAGE = "localhost/hf-parallel-toolkit:cpu-test"
# make image-cpu / image-gpu: Dockerfile and tag.
IMAGES = {"cpu": ("docker/Dockerfile.cpu", "localhost/hf-parallel-toolkit:cpu"),
          "gpu": ("docker/Dockerfile", "localhost/hf-parallel-toolkit:gpu")}
HOST_CA = "/etc/ssl/certs/ca-certificates.crt"
WORK = Path(tempfile.gettempdir()) / f"toolkit-container-build-{os.getuid()}"
BUILD_ID_ENV = "TOOLKIT_CONTAINER_BUILD_ID"
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


def build_image(dockerfile: str = "docker/Dockerfile.cpu", tag: str = IMAGE, timeout: float = 1800) -> str:
    """``dockerfile`` built on the debootstrapped base as ``tag``. Only the CPU image is given the host's
    wheel folder (it holds torch's CPU wheel); the GPU image takes PyPI's CUDA build."""
    build_base()
    args = ["build", "--network", "host", "-f", dockerfile, "-t", tag,
            "--build-arg", f"BASE_IMAGE={BASE}",
            "--build-arg", "PIP_CERT=/etc/ssl/certs/host-ca.crt", "--volume", f"{HOST_CA}:/etc/ssl/certs/host-ca.crt:ro"]
    wheels = os.environ.get("PIP_FIND_LINKS", "/opt/wheels")
    if dockerfile.endswith(".cpu") and glob.glob(f"{wheels}/torch-*.whl"):  # else the CPU index is asked
        args += ["--build-arg", "PIP_FIND_LINKS=/wheels", "--volume", f"{wheels}:/wheels:ro"]
    checked(podman(*args, str(REPO), timeout=timeout))
    return tag


def build_and_measure(kind: str) -> int:
    """``make image-gpu`` / ``image-cpu`` without a Docker engine: build, then print the time and size."""
    reason = missing_tools()
    if reason:
        print(f"error: cannot build with podman here: {reason}", file=sys.stderr)
        return 2
    dockerfile, tag = IMAGES[kind]
    had_base = podman("image", "exists", BASE).returncode == 0
    start = time.monotonic()
    try:
        build_image(dockerfile, tag, timeout=7200)
    except (RuntimeError, subprocess.SubprocessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    minutes = (time.monotonic() - start) / 60
    size = int(checked(podman("image", "inspect", "--format", "{{.Size}}", tag)).strip())
    print(f"built {tag} from {dockerfile} in {minutes:.1f} min ({'on the existing' if had_base else 'with'} base {BASE}); "
          f"image size {size / 1e9:.2f} GB ({size / 2**30:.2f} GiB)")
    if kind == "gpu":
        record_gpu_lock(tag)
    return 0


def record_gpu_lock(tag: str) -> None:
    """docker/gpu-image.lock: the GPU image's installed versions, which benchmarks/gpu_wheels.py
    carries to the GPU machine where constraints.txt pins nothing."""
    freeze = checked(podman("run", "--rm", "--network", "none", tag, "pip", "freeze", "--exclude-editable"))
    lines = sorted((line for line in freeze.splitlines() if "==" in line), key=str.lower)
    header = ["# The GPU image's Python packages: `pip freeze` in the image `make image-gpu` built",
              f"# (docker/Dockerfile on {BASE}, {time.strftime('%Y-%m-%d')}). Written by",
              "# tests/helpers/container_image.py; read by benchmarks/gpu_wheels.py. Not an install input."]
    (REPO / "docker" / "gpu-image.lock").write_text("\n".join(header + lines) + "\n")
    print(f"recorded {len(lines)} versions in docker/gpu-image.lock")


def _status_file() -> Path | None:
    """Where this test session's background build reports its exit code. The id is shared with
    pytest-xdist workers through the environment, so whichever worker runs the container tests can
    wait for a build that the controller started."""
    build_id = os.environ.get(BUILD_ID_ENV)
    return WORK / f"build-{build_id}.rc" if build_id else None


def start_background_build() -> int | None:
    """Start the build now, niced, so it uses the cores the other tests leave idle; its process id
    (the leader of its own process group). Nothing when this build id's build was already started,
    as ``.ci/run`` does before ``make test`` so that the build overlaps the set-up too."""
    global _background
    if _background is not None or missing_tools():
        return None
    WORK.mkdir(exist_ok=True)
    os.environ.setdefault(BUILD_ID_ENV, uuid.uuid4().hex)
    status = _status_file()
    if (WORK / f"{status.name}.started").exists():
        return None
    status.unlink(missing_ok=True)
    log = open(WORK / "build.log", "wb")
    _background = subprocess.Popen(["nice", "-n", "19", "ionice", "-c", "3", sys.executable, "-m",
                                    "tests.helpers.container_image", str(status)], cwd=REPO, stdout=log,
                                   stderr=subprocess.STDOUT,
                                   start_new_session=True)  # its own group: stopped whole, podman included
    (WORK / f"{status.name}.started").touch()
    return _background.pid


def stop_background_build() -> None:
    if _background is None:
        return
    if _background.poll() is None:
        os.killpg(_background.pid, signal.SIGKILL)
        _background.wait()
    status = _status_file()
    for path in (status, WORK / f"{status.name}.started"):
        path.unlink(missing_ok=True)


def image_ready(timeout_s: float = 2400) -> str:
    """The built image: waits for the background build, or builds here when there was none."""
    status = _status_file()
    if status is None or not (WORK / f"{status.name}.started").exists():
        return build_image()
    deadline = time.monotonic() + timeout_s
    while not status.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"background image build did not finish in {timeout_s:.0f}s")
        time.sleep(2)
    if status.read_text().strip() != "0":
        raise RuntimeError(f"background image build failed:\n{(WORK / 'build.log').read_text()[-6000:]}")
    return IMAGE


def _build_and_report(status: Path) -> int:
    try:
        print(build_image(), flush=True)
        code = 0
    except Exception as exc:  # the log is what the waiting fixture shows
        print(exc, flush=True)
        code = 1
    tmp = status.with_suffix(".tmp")
    tmp.write_text(str(code))
    tmp.replace(status)  # whole or absent: the waiter never reads a half-written code
    return code


if __name__ == "__main__":
    if sys.argv[1:2] == ["--build"] and sys.argv[2:] and sys.argv[2] in IMAGES:  # the Makefile's image targets
        sys.exit(build_and_measure(sys.argv[2]))
    if sys.argv[1:] == ["--detach"]:  # .ci/run: start the build for $TOOLKIT_CONTAINER_BUILD_ID, print its pid
        if BUILD_ID_ENV not in os.environ:
            sys.exit(f"--detach needs {BUILD_ID_ENV} set: the test session finds the build by it")
        print(start_background_build() or "")
        sys.exit(0)
    sys.exit(_build_and_report(Path(sys.argv[1])))

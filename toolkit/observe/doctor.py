"""``toolkit doctor``: what is installed, what the hardware is, and whether it is the tested matrix."""
from __future__ import annotations

import importlib.metadata as md
import platform
from pathlib import Path

REQUIRED = ("torch", "deepspeed", "transformers", "datasets", "safetensors", "pydantic")
OPTIONAL = ("megatron-core", "accelerate", "tokenizers", "transformer-engine", "tensorboard", "bitsandbytes")


def pinned_versions(text: str | None = None) -> dict[str, str]:
    """The tested version matrix (the package's copy of requirements/constraints.txt) by name."""
    from toolkit import resources
    pins = {}
    for line in (resources.constraints() if text is None else text).splitlines():
        line = line.split("#")[0].strip()
        if "==" in line:
            name, version = line.split("==")
            pins[_norm(name)] = version.strip()
    return pins


def _norm(name: str) -> str:
    return name.strip().lower().replace("_", "-")


def installed(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def diagnose() -> tuple[list[str], list[str], list[str]]:
    """(report lines, warnings, errors)."""
    lines, warnings, errors = [f"python        {platform.python_version()} ({platform.machine()})"], [], []
    pins = pinned_versions()
    for name in REQUIRED + OPTIONAL:
        version = installed(name)
        pin = pins.get(_norm(name))
        lines.append(f"{name:13s} {version or '-'}" + (f"   (tested: {pin})" if pin else ""))
        if version is None and name in REQUIRED:
            errors.append(f"{name} is not installed: pip install -c requirements/constraints.txt -e .")
        elif version and pin and version.split("+")[0] != pin:
            warnings.append(f"{name} {version} is not the tested {pin}; `make setup` installs the tested matrix")
    lines += _shipped_files_lines(errors)
    lines += _hardware_lines(errors)
    return lines, warnings, errors


def _shipped_files_lines(errors: list[str]) -> list[str]:
    """The files the CLI needs from the package: presets and the demo (a wheel without them could
    train nothing by name)."""
    from toolkit import resources
    from toolkit.config import DEMO_DIR
    found = {kind: sorted(resources.presets(kind)) for kind in resources.PRESET_KINDS}
    demo = [DEMO_DIR / "tiny-llama" / "config.json", DEMO_DIR / "corpus.txt"]
    for kind, names in found.items():
        if not names:
            errors.append(f"no {kind} presets in the installed package ({resources.__name__}); reinstall the toolkit")
    missing = [str(p) for p in demo if not p.is_file()]
    if missing:
        errors.append(f"the demo is incomplete, missing {missing}; reinstall the toolkit")
    return [f"presets       deepspeed {', '.join(found['deepspeed']) or '-'}; megatron {', '.join(found['megatron']) or '-'}",
            f"demo          {'ok' if not missing else 'missing ' + ', '.join(missing)} ({DEMO_DIR})"]


def _hardware_lines(errors: list[str]) -> list[str]:
    try:
        import torch
    except ImportError:
        return []
    return hardware_lines(errors, driver_gpus(), torch.__version__, torch.version.cuda, torch.cuda.is_available())


def driver_gpus() -> list[str]:
    """The NVIDIA GPUs the driver lists (``nvidia-smi -L`` lines), whatever torch was built for."""
    import shutil
    import subprocess
    if shutil.which("nvidia-smi") is None:
        return [p.name for p in sorted(Path("/proc/driver/nvidia/gpus").glob("*"))]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.startswith("GPU ")]


def hardware_lines(errors: list[str], gpus: list[str], torch_version: str, torch_cuda: str | None,
                   cuda_available: bool) -> list[str]:
    """What the machine has against what torch can use: a CPU-only torch on a machine with NVIDIA
    GPUs, or a CUDA torch that cannot reach them, is an error (training would run on the CPU). A
    CUDA build says its CUDA and NCCL versions whether or not a GPU is visible (the GPU image
    built on a machine without one)."""
    if gpus and torch_cuda is None:
        errors.append(f"torch {torch_version} is a CPU-only build but the machine has {len(gpus)} NVIDIA GPU(s) "
                      "(nvidia-smi -L): install torch's CUDA build, e.g. pip install torch==<pinned version> "
                      "--index-url https://download.pytorch.org/whl/cu130, or use the GPU image (docker/Dockerfile)")
    elif gpus and not cuda_available:
        errors.append(f"torch {torch_version} (CUDA {torch_cuda}) cannot use the machine's {len(gpus)} GPU(s): check the "
                      "driver version against that CUDA and CUDA_VISIBLE_DEVICES")
    lines = [] if torch_cuda is None else [f"cuda          {torch_cuda} (torch's build)   nccl {nccl_version()}"]
    if not cuda_available:
        seen = f"driver lists {len(gpus)} GPU(s)" if gpus else "no GPU visible"
        return lines + [f"devices       CPU only ({seen}): DeepSpeed uses its CPU accelerator with gloo; the "
                        "Megatron path uses toolkit.compat.megatron_cpu"]
    import torch
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"gpu {i}         {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    return lines + _deepspeed_ops_lines()


def nccl_version() -> str:
    """The NCCL torch loads (read from the library, no GPU needed); '-' where torch has none."""
    import torch
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):  # a CPU build has no NCCL
        return "-"
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def _deepspeed_ops_lines() -> list[str]:
    try:
        from toolkit.adapters.deepspeed import prebuilt_ops
    except ImportError:
        return []
    built = prebuilt_ops()
    return [f"deepspeed ops {', '.join(built) or 'none prebuilt (JIT-compiled on first use)'}"]


def main() -> int:
    lines, warnings, errors = diagnose()
    print("\n".join(lines))
    for w in warnings:
        print(f"warning: {w}")
    for e in errors:
        print(f"error: {e}")
    print("ok" if not errors else "problems found")
    return 1 if errors else 0

"""``toolkit doctor``: what is installed, what the hardware is, and whether it is the tested matrix."""
from __future__ import annotations

import importlib.metadata as md
import platform
from pathlib import Path

PINS = Path(__file__).resolve().parents[1] / "requirements" / "constraints.txt"
REQUIRED = ("torch", "deepspeed", "transformers", "datasets", "safetensors", "pydantic")
OPTIONAL = ("megatron-core", "accelerate", "tokenizers", "transformer-engine", "tensorboard")


def pinned_versions(path: Path = PINS) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines() if path.exists() else []:
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
    lines += _hardware_lines(errors)
    return lines, warnings, errors


def _hardware_lines(errors: list[str]) -> list[str]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return ["devices      CPU only: DeepSpeed uses its CPU accelerator with gloo; the Megatron path uses "
                "toolkit.compat.megatron_cpu"]
    lines = [f"cuda          {torch.version.cuda}   nccl {'.'.join(map(str, torch.cuda.nccl.version()))}"]
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"gpu {i}         {p.name}, {p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}")
    if torch.version.cuda is None:
        errors.append("torch was built without CUDA on a machine with GPUs: install the CUDA build of torch")
    return lines + _deepspeed_ops_lines()


def _deepspeed_ops_lines() -> list[str]:
    try:
        from deepspeed.git_version_info import installed_ops
    except ImportError:
        return []
    built = sorted(op for op, ok in installed_ops.items() if ok)
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

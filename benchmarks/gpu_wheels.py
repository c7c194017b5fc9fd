"""The wheels the GPU machine lacks, carried in ``.whl/`` (that machine reaches no package registry).

    python3 benchmarks/gpu_wheels.py fetch            # here, online: download + build into .whl/
    python3 benchmarks/gpu_wheels.py check            # here, offline: the bundle is complete and
                                                      # installs on CPython 3.12 without an index
    python3 benchmarks/gpu_wheels.py install TARGET   # on the GPU machine: into TARGET only, then
                                                      # export PYTHONPATH=TARGET:$PYTHONPATH

The GPU machine (shared/FIELD_NOTES.md, "The GPU machine") runs CPython 3.12 on x86_64 Linux
(manylinux_2_28) with its own torch and transformers; what the toolkit needs beyond that
(``ROOTS`` and their dependencies, minus ``PREINSTALLED``, plus ``OVERRIDES`` and ``TESTED``) is
downloaded as cp312 manylinux or pure-Python wheels, at the versions pinned in
requirements/constraints.txt where pinned, else at the GPU image's (docker/gpu-image.lock, what
``pip freeze`` printed in the image ``make image-gpu`` built) where they fit: the check then runs what
the image runs, except torch (the machine's own; a CUDA torch is GBs, the carry limit 64 MiB) and
what stays the machine's. ``fetch`` and ``check`` list every carried version that differs from the
image's, and the image's packages left to the machine (docs/gpus.md has the list).
DeepSpeed has only an sdist: it is built here into a pure-Python wheel with ``DS_BUILD_OPS=0``
(no op compiled; on the GPU machine DeepSpeed JIT-builds its ops with that machine's nvcc and
ninja). The folder must stay under 64 MiB (what a run there may carry).

Standard library only (it runs on both machines); requirement markers and version ranges are
read with ``packaging``, or pip's vendored copy where ``packaging`` is not installed.
"""
from __future__ import annotations

import argparse
import email.parser
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WHEELS = REPO / ".whl"
PINS = REPO / "requirements" / "constraints.txt"
# The GPU image's installed versions (``make image-gpu`` writes it): what an unpinned carried package
# is downloaded at when it fits every range that asks for it.
IMAGE_LOCK = REPO / "docker" / "gpu-image.lock"
LIMIT = 64 * 1024 * 1024

# What the toolkit needs on the GPU machine (benchmarks/gpu_check.py: NEEDED). PyYAML is skipped when
# PREINSTALLED has it. nvidia-ml-py: DeepSpeed's setup.py adds it to its requirements only when
# built against a CUDA torch (not so here); with it, DeepSpeed reads free GPU memory from NVML.
ROOTS = ("deepspeed", "megatron-core", "datasets", "pydantic", "einops", "rich", "PyYAML", "nvidia-ml-py",
         "bitsandbytes")

# Carried with only the native libraries the GPU machine loads: bitsandbytes 0.50.2 ships one per
# CUDA, ROCm and XPU version (41 MiB); with torch 2.11.0+cu130 it loads libbitsandbytes_cuda130.so
# (cextension.py: the name from torch.version.cuda), on the CPU libbitsandbytes_cpu.so. ``fetch``
# repacks the wheel without the others (RECORD rewritten, 3.5 MiB); ``check`` refuses one that has them.
SLIM = {"bitsandbytes": re.compile(r"bitsandbytes/libbitsandbytes_(cpu|cuda130)\.so")}
NATIVE = re.compile(r".+\.so(\.[0-9]+)*")

# Already on the GPU machine, so never carried. Source: shared/FIELD_NOTES.md, "The GPU machine":
# torch 2.11.0+cu130, transformers 5.17, accelerate, peft, safetensors, tokenizers, pyarrow, pytest,
# pytest-xdist, ninja (and nvcc 13); plus their unconditional Requires-Dist for CPython 3.12 on
# Linux, read from the index's metadata (`pip install --dry-run --report`, 2026-12-05) of torch
# 2.11.0, transformers 5.17.0, accelerate 1.16.0, peft 0.21.2, huggingface_hub 1.5.0 .. 1.33.0
# (the range transformers 5.17 allows), tokenizers 0.23, pytest 9, pytest-xdist 3.8.
# Left out on purpose although transformers' `typer` may bring them: pydantic (FIELD_NOTES: not
# there) and rich with its markdown-it-py/mdurl (it depends on the typer version): carried instead.
# Value: the version where FIELD_NOTES fixes it (checked against the bundle's ranges), else None
# (`check` lists those ranges as assumed; `install` checks them on the GPU machine itself). numpy,
# safetensors and triton: the versions a session's `pip list` there showed (device KINDS.md, 2026-11).
PREINSTALLED: dict[str, str | None] = {
    # the machine's own
    "torch": "2.11.0", "transformers": "5.17.0", "accelerate": None, "peft": None,
    "safetensors": "0.8.0", "tokenizers": None, "pyarrow": None, "pytest": None, "pytest-xdist": None,
    "ninja": None,
    # torch 2.11.0 (Linux)
    "filelock": None, "typing-extensions": None, "setuptools": None, "sympy": None, "mpmath": None,
    "networkx": None, "jinja2": None, "markupsafe": None, "fsspec": None, "triton": "3.6.0",
    "cuda-toolkit": None, "cuda-bindings": None, "nvidia-cudnn-cu13": None,
    "nvidia-cusparselt-cu13": None, "nvidia-nccl-cu13": None, "nvidia-nvshmem-cu13": None,
    # transformers 5.17, accelerate, peft, tokenizers
    "huggingface-hub": None, "numpy": "2.5.2", "packaging": None, "pyyaml": None, "regex": None,
    "tqdm": None, "psutil": None, "typer": None,
    # huggingface_hub 1.x and its httpx
    "hf-xet": None, "httpx": None, "httpcore": None, "h11": None, "anyio": None, "idna": None,
    "certifi": None, "click": None, "shellingham": None,
    # pytest 9, pytest-xdist
    "iniconfig": None, "pluggy": None, "pygments": None, "execnet": None,
    # the device tool's list of the machine image's packages (/work/.library/device/KINDS.md, read on
    # 2026-11-17): what datasets and DeepSpeed need beyond the above (pandas alone is 11.5 MiB)
    "pandas": None, "python-dateutil": None, "six": None, "msgpack": None, "xxhash": None,
    "py-cpuinfo": None, "einops": None, "nvidia-ml-py": None,
}

# Carried although the GPU machine has them: a carried package needs a newer one than it may have.
# Value: the range the GPU machine's own packages accept; the pin in constraints.txt does not apply.
OVERRIDES = {
    # datasets 5.2.0 needs huggingface-hub>=1.31 (it imports HfFileSystemResolvedBucketPath; with
    # 1.5.0 `import datasets` fails); transformers 5.17 accepts >=1.5.0,<2.0, so the machine may
    # have any of those. The carried one shadows it on PYTHONPATH.
    "huggingface-hub": ">=1.5.0,<2.0",
    # pydantic-core 2.46 needs typing-extensions>=4.14.1; the machine's own version is not known.
    "typing-extensions": ">=4.14.1",
    # The carried transformers 5.24 checks regex>=2025.10.22 at import, megatron-core 0.16 needs
    # packaging>=24.2; the machine's versions are not known (small wheels: carried rather than assumed).
    "regex": ">=2025.10.22",
    "packaging": ">=24.2",
}

# Carried at the pins of requirements/constraints.txt although the GPU machine has other versions,
# so the check runs the tested transformers and peft (the machine's transformers 5.17 gives gemma2
# sdpa attention, which 5.24 does not), accelerate (1.15 there) and tokenizers (0.23.2 there), as the
# image does. `install --without transformers,peft` leaves those two out to run on the machine's own
# (benchmarks/gpu_check.py --machine-transformers).
TESTED = ("transformers", "peft", "accelerate", "tokenizers")

# Where the wheels must install: CPython 3.12, x86_64 Linux, glibc 2.28, which runs every manylinux
# tag up to 2_28. Each is named: pip expands only the legacy manylinux2014 to older tags, not 2_28.
PLATFORMS = (*(f"manylinux_2_{minor}_x86_64" for minor in range(28, 16, -1)), "manylinux2014_x86_64")
TARGET_ARGS = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp",
               *[arg for p in PLATFORMS for arg in ("--platform", p)]]
TARGET_ENV = {"python_version": "3.12", "python_full_version": "3.12.3", "implementation_name": "cpython",
              "implementation_version": "3.12.3", "platform_python_implementation": "CPython",
              "os_name": "posix", "sys_platform": "linux", "platform_system": "Linux",
              "platform_machine": "x86_64", "platform_release": "", "platform_version": "", "extra": ""}


def _packaging():
    """``(Requirement, Version)`` from ``packaging``, else from pip's vendored copy."""
    try:
        from packaging.requirements import Requirement
        from packaging.version import Version
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import Requirement
            from pip._vendor.packaging.version import Version
        except ImportError:
            sys.exit("error: neither `packaging` nor pip is importable; run with a Python that has pip")
    return Requirement, Version


def norm(name: str) -> str:
    """PEP 503 name: what wheel file names, Requires-Dist and PREINSTALLED are compared by."""
    return re.sub(r"[-_.]+", "-", name).lower()


def pip(*args: str, env: dict | None = None, quiet: bool = False) -> subprocess.CompletedProcess:
    """Run this Python's pip; ``quiet`` captures its output (for the error message) instead of showing it."""
    cmd = [sys.executable, "-m", "pip", *args]
    return subprocess.run(cmd, env=env, text=True, capture_output=quiet)


def read_pins(path: Path = PINS) -> dict[str, str]:
    """``name -> version`` for every ``name==version`` line of requirements/constraints.txt (or ``path``)."""
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"\s*([A-Za-z0-9._-]+)\s*==\s*([^\s;#]+)", line)
        if m:
            pins[norm(m.group(1))] = m.group(2)
    return pins


def image_versions() -> dict[str, str]:
    """The GPU image's ``name -> version`` (docker/gpu-image.lock; empty where it was never recorded)."""
    return read_pins(IMAGE_LOCK) if IMAGE_LOCK.is_file() else {}


class Wheel:
    """One wheel file: its distribution name, version and Requires-Dist (from METADATA)."""

    def __init__(self, path: Path):
        self.path = path
        with zipfile.ZipFile(path) as z:
            meta = [n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n)]
            if len(meta) != 1:
                raise SystemExit(f"error: {path.name} has no (or several) *.dist-info/METADATA; "
                                 f"delete it and run fetch again")
            msg = email.parser.Parser().parsestr(z.read(meta[0]).decode("utf-8"))
        self.name, self.version = norm(msg["Name"]), msg["Version"]
        self.requires = msg.get_all("Requires-Dist") or []

    def needs(self) -> list:
        """The Requirements that apply on CPython 3.12 Linux x86_64, without this wheel's extras."""
        Requirement, _ = _packaging()
        reqs = [Requirement(r) for r in self.requires]
        return [r for r in reqs if r.marker is None or r.marker.evaluate(TARGET_ENV)]


def bundle(folder: Path) -> dict[str, list[Wheel]]:
    """The folder's wheels by normalized name (a list, so duplicates can be reported)."""
    found: dict[str, list[Wheel]] = {}
    for path in sorted(folder.glob("*.whl")):
        w = Wheel(path)
        found.setdefault(w.name, []).append(w)
    return found


def _spec(text: str):
    """A SpecifierSet from a range such as ">=1.5,<2"."""
    Requirement, _ = _packaging()
    return Requirement("x" + text).specifier


def admits(spec, version: str) -> bool:
    """Whether a SpecifierSet admits ``version`` (pre-releases allowed: a pin may be one)."""
    _, Version = _packaging()
    return spec.contains(Version(version), prereleases=True)


# ---------------------------------------------------------------------------------------- fetch

def carried(name: str) -> bool:
    """Whether the bundle carries ``name``: not on the GPU machine, or an OVERRIDE."""
    return name not in PREINSTALLED or name in OVERRIDES or name in TESTED


def demands(wheels: dict[str, list[Wheel]]) -> dict[str, list[tuple[str, object]]]:
    """What ROOTS, OVERRIDES and the wheels so far ask the bundle for: ``name -> [(by, spec)]``."""
    Requirement, _ = _packaging()
    asked = {norm(r): [("ROOTS", Requirement(r).specifier)] for r in ROOTS if carried(norm(r))}
    for name, spec in OVERRIDES.items():
        asked.setdefault(name, []).append(("OVERRIDES", _spec(spec)))
    for name in TESTED:
        asked.setdefault(name, []).append(("TESTED", _spec("")))
    for ws in wheels.values():
        for w in ws:
            for r in w.needs():
                if carried(norm(r.name)):
                    asked.setdefault(norm(r.name), []).append((f"{w.name} {w.version}", r.specifier))
    return asked


def wanted_spec(name: str, asks: list, pins: dict[str, str], image: dict[str, str] | None = None) -> str:
    """The requirement to download: the pin if pinned (it must satisfy every asker), else the GPU
    image's version if it satisfies every asker (an OVERRIDE's range included), else their ranges."""
    if name in pins and name not in OVERRIDES:
        bad = [f"{by} wants {name}{spec}" for by, spec in asks if not admits(spec, pins[name])]
        if bad:
            sys.exit(f"error: the pin {name}=={pins[name]} (requirements/constraints.txt) conflicts: "
                     f"{'; '.join(bad)}. Fix: change the pin or the package that asks for it.")
        return f"{name}=={pins[name]}"
    version = (image or {}).get(name)
    if version and all(admits(spec, version) for _, spec in asks):
        return f"{name}=={version}"
    return name + ",".join(str(spec) for _, spec in asks if str(spec))


def image_differences(wheels: dict[str, list[Wheel]], image: dict[str, str]) -> list[str]:
    """Where what the check runs is not what the GPU image runs: carried wheels at another version,
    and the image's packages that the GPU machine's own copy (any version) stands in for."""
    if not image:
        return [f"no {IMAGE_LOCK.relative_to(REPO)} (make image-gpu records it): versions not compared"]
    out = [f"{n} {ws[0].version} carried, the image has {image[n]}" + (f" ({n} must fit {OVERRIDES[n]})"
                                                                       if n in OVERRIDES else "")
           for n, ws in sorted(wheels.items()) if n in image and ws[0].version != image[n]]
    mine = sorted(n for n in image if n not in wheels and n in PREINSTALLED)
    mine_known = [f"{n} {PREINSTALLED[n]}" if PREINSTALLED[n] else n for n in mine]
    if mine:
        out.append(f"the GPU machine's own, not the image's: {', '.join(mine_known)}")
    others = sorted(n for n in image if n not in wheels and n not in PREINSTALLED)
    if others:
        out.append("not carried, not imported by the check's own code (the GPU machine's copies where it has "
                   f"them, e.g. its torch's nvidia-* libraries): {', '.join(others)}")
    return out


def satisfied(name: str, asks: list, wheels: dict[str, list[Wheel]]) -> bool:
    """Whether exactly one wheel of ``name`` is there and its version fits every asker's range."""
    ws = wheels.get(name, [])
    return len(ws) == 1 and all(admits(spec, ws[0].version) for _, spec in asks)


def download(requirement: str, dest: Path) -> None:
    """One wheel for CPython 3.12 manylinux x86_64 (or pure Python), without its dependencies."""
    print(f"[fetch] {requirement}", flush=True)
    r = pip("download", "--no-deps", *TARGET_ARGS, "--dest", str(dest), requirement, quiet=True)
    if r.returncode:
        sys.exit(f"error: no wheel for {requirement} on CPython 3.12 manylinux x86_64:\n{r.stderr[-1500:]}\n"
                 f"Fix: pin a version that has one in requirements/constraints.txt, or build it here "
                 f"(`pip wheel --no-deps`) if it is pure Python, as done for deepspeed.")


def build_deepspeed(version: str, dest: Path) -> None:
    """DeepSpeed's sdist built into a pure-Python wheel, no op compiled (DS_BUILD_OPS=0).

    Built in pip's isolated build env, so no torch is imported: setup.py then records
    torch_info "0.0" (the "detect at run time" value) and no installed op, so DeepSpeed JIT-builds
    each op on first use with the GPU machine's torch, nvcc and ninja.
    """
    print(f"[fetch] deepspeed=={version} (sdist -> pure-Python wheel, DS_BUILD_OPS=0)", flush=True)
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    r = pip("wheel", "--no-deps", "--no-cache-dir", "--no-binary", "deepspeed", "--wheel-dir", str(dest),
            f"deepspeed=={version}", env=env, quiet=True)
    if r.returncode:
        sys.exit(f"error: building the deepspeed {version} wheel failed:\n{r.stderr[-2000:]}")
    problem = deepspeed_problem(dest)
    if problem:
        sys.exit(f"error: {problem}")


def deepspeed_problem(folder: Path) -> str | None:
    """Why the folder's DeepSpeed wheel is not the pure-Python, JIT-only one; None if it is."""
    found = sorted(folder.glob("deepspeed-*.whl"))
    if len(found) != 1:
        return f"expected one deepspeed wheel in {folder}, found {[p.name for p in found]}"
    if not found[0].name.endswith("-py3-none-any.whl"):
        return f"{found[0].name} is not a pure-Python wheel; rebuild with DS_BUILD_OPS=0"
    with zipfile.ZipFile(found[0]) as z:
        compiled = [n for n in z.namelist() if n.endswith((".so", ".pyd"))]
        info = z.read("deepspeed/git_version_info_installed.py").decode()
    if compiled or re.search(r"installed_ops=.*True", info):
        return f"{found[0].name} carries compiled ops ({compiled[:3]}); rebuild with DS_BUILD_OPS=0"
    return None


def resolve(stage: Path, pins: dict[str, str], image: dict[str, str] | None = None) -> None:
    """Download into ``stage`` until every requirement not PREINSTALLED has one fitting wheel."""
    for _ in range(20):
        wheels = bundle(stage)
        todo = {n: a for n, a in demands(wheels).items() if not satisfied(n, a, wheels)}
        if not todo:
            return
        for name, asks in sorted(todo.items()):
            for w in wheels.get(name, []):
                w.path.unlink()
            download(wanted_spec(name, asks, pins, image), stage)
    sys.exit("error: the requirements did not settle in 20 rounds; run check to see which conflict")


def slim(folder: Path) -> None:
    """Repack each ``SLIM`` wheel in ``folder`` without the native libraries its pattern does not keep."""
    for name, keep in SLIM.items():
        for w in bundle(folder).get(name, []):
            dropped = extra_libraries(w.path, keep)
            if not dropped:
                continue
            repacked = w.path.with_suffix(".slim")
            with zipfile.ZipFile(w.path) as src, zipfile.ZipFile(repacked, "w", zipfile.ZIP_DEFLATED) as dst:
                for info in src.infolist():
                    if info.filename in dropped:
                        continue
                    data = src.read(info)
                    if re.fullmatch(r"[^/]+\.dist-info/RECORD", info.filename):
                        rows = data.decode().splitlines(keepends=True)
                        data = "".join(r for r in rows if r.split(",", 1)[0] not in dropped).encode()
                    dst.writestr(info, data)
            repacked.replace(w.path)
            print(f"[fetch] {w.path.name}: dropped {len(dropped)} native libraries, kept {keep.pattern}")


def extra_libraries(path: Path, keep) -> set[str]:
    """The native libraries in the wheel at ``path`` that ``keep`` does not match."""
    with zipfile.ZipFile(path) as z:
        return {n for n in z.namelist() if NATIVE.fullmatch(n) and not keep.fullmatch(n)}


def fetch(args) -> int:
    """Download and build the bundle in a staging folder, then replace .whl/'s wheels with it."""
    pins = read_pins()
    if "deepspeed" not in pins:
        sys.exit(f"error: no deepspeed==VERSION line in {PINS}; the wheel is built from that version")
    skipped = sorted(r for r in ROOTS if norm(r) in PREINSTALLED)
    print(f"[fetch] already on the GPU machine, not carried: {', '.join(skipped) or '-'}")
    with tempfile.TemporaryDirectory(prefix="gpu_wheels_") as tmp:
        stage = Path(tmp)
        build_deepspeed(pins["deepspeed"], stage)
        resolve(stage, pins, image_versions())
        slim(stage)
        args.dir.mkdir(exist_ok=True)
        for old in args.dir.glob("*.whl"):
            old.unlink()
        for new in stage.glob("*.whl"):
            shutil.move(str(new), args.dir / new.name)
    rc = report_size(args.dir)
    report_image_differences(args.dir)
    return rc


def report_image_differences(folder: Path) -> None:
    for line in image_differences(bundle(folder), image_versions()):
        print(f"not as in the GPU image: {line}")


def report_size(folder: Path) -> int:
    """Print every wheel with its size and the total; 1 if over the 64 MiB limit."""
    total = 0
    for ws in bundle(folder).values():
        for w in ws:
            size = w.path.stat().st_size
            total += size
            print(f"  {w.name:24} {w.version:14} {size / 2**20:7.2f} MiB")
    print(f"total {total / 2**20:.2f} MiB in {folder} (limit {LIMIT / 2**20:.0f} MiB)")
    if total > LIMIT:
        print("error: over the limit; drop what the GPU machine has (PREINSTALLED) or a heavy optional "
              "dependency", file=sys.stderr)
        return 1
    return 0


# ---------------------------------------------------------------------------------------- check

def requirement_problems(wheels: dict[str, list[Wheel]]) -> tuple[list[str], list[str], list[str]]:
    """(missing or wrong versions, ranges assumed on PREINSTALLED, extras not carried)."""
    problems, assumed, extras = [], [], []
    for ws in wheels.values():
        for w in ws:
            for r in w.needs():
                name, by = norm(r.name), f"{w.name} {w.version}"
                if r.extras:
                    extras.append(f"{by} asks for {name}[{','.join(sorted(r.extras))}]: "
                                  f"the extra's own packages are not carried")
                if name in wheels:
                    have = wheels[name][0].version
                    if not admits(r.specifier, have):
                        problems.append(f"{by} needs {name}{r.specifier}, the bundle has {have}")
                elif name in PREINSTALLED:
                    have = PREINSTALLED[name]
                    if have and not admits(r.specifier, have):
                        problems.append(f"{by} needs {name}{r.specifier}, the GPU machine has {have}")
                    elif not have and str(r.specifier):
                        assumed.append(f"{name}{r.specifier} (for {by})")
                else:
                    problems.append(f"MISSING {name}{r.specifier} (needed by {by}): "
                                    f"in neither .whl/ nor PREINSTALLED")
    return problems, sorted(set(assumed)), sorted(set(extras))


def bundle_problems(wheels: dict[str, list[Wheel]], folder: Path) -> list[str]:
    """Roots absent, duplicate wheels, wheels of what the GPU machine already has, a compiled DeepSpeed."""
    problems = [f"MISSING {r}: a root, in neither .whl/ nor PREINSTALLED" for r in ROOTS
                if norm(r) not in wheels and norm(r) not in PREINSTALLED]
    problems += [f"{n}: {len(ws)} wheels ({', '.join(w.path.name for w in ws)}); keep one"
                 for n, ws in wheels.items() if len(ws) > 1]
    problems += [f"{n}: carried but PREINSTALLED (it would shadow the GPU machine's copy); drop it"
                 for n in wheels if not carried(n)]
    problems += [f"{n}: an OVERRIDE, but not carried" for n in OVERRIDES if n not in wheels]
    problems += [f"{n}: TESTED, but not carried" for n in TESTED if n not in wheels]
    problems += [f"{n} {wheels[n][0].version} is outside {spec}, what the GPU machine's packages accept"
                 for n, spec in OVERRIDES.items()
                 if n in wheels and not admits(_spec(spec), wheels[n][0].version)]
    problems += [f"{w.path.name} carries native libraries the GPU machine never loads ({len(extra)}: "
                 f"{sorted(extra)[:2]}...); rerun fetch (it repacks the wheel: SLIM)"
                 for n, keep in SLIM.items() for w in wheels.get(n, [])
                 for extra in [extra_libraries(w.path, keep)] if extra]
    if "deepspeed" in wheels:
        problems += [p for p in [deepspeed_problem(folder)] if p]
    return problems


def rehearse_install(folder: Path) -> list[str]:
    """Install every wheel for CPython 3.12 manylinux_2_28 into a scratch dir, with no index at all."""
    base = ["install", "--isolated", "--no-index", "--no-deps", "--find-links", str(folder),
            *TARGET_ARGS, "--no-compile", "--quiet"]
    paths = [str(p) for p in sorted(folder.glob("*.whl"))]
    with tempfile.TemporaryDirectory(prefix="gpu_wheels_check_") as tmp:
        if pip(*base, "--target", tmp, *paths, quiet=True).returncode == 0:
            return []
    failed = []
    for path in paths:  # one by one, to name the wheels that do not install
        with tempfile.TemporaryDirectory(prefix="gpu_wheels_check_") as tmp:
            r = pip(*base, "--target", tmp, path, quiet=True)
            if r.returncode:
                why = (r.stderr.strip().splitlines() or ["(no message)"])[-1]
                failed.append(f"{Path(path).name} does not install for CPython 3.12 manylinux_2_28 "
                              f"x86_64 offline: {why}")
    return failed or ["the offline install of all wheels together failed (each alone installs)"]


def check(args) -> int:
    """Complete (every requirement met by the bundle or PREINSTALLED), installable offline, in size."""
    wheels = bundle(args.dir) if args.dir.is_dir() else {}
    if not wheels:
        print(f"error: no wheels in {args.dir}. Fix: run `python3 benchmarks/gpu_wheels.py fetch` on "
              f"a machine that reaches PyPI.", file=sys.stderr)
        return 1
    problems, assumed, extras = requirement_problems(wheels)
    problems += bundle_problems(wheels, args.dir)
    problems += rehearse_install(args.dir)
    size_rc = report_size(args.dir)
    report_image_differences(args.dir)
    for line in assumed:
        print(f"assumed on the GPU machine (its version unknown here): {line}")
    for line in extras:
        print(f"note: {line}")
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if problems or size_rc:
        print("check FAILED. Fix: rerun fetch (online), or add the named package to ROOTS, PREINSTALLED "
              "or OVERRIDES in benchmarks/gpu_wheels.py if that is where it belongs.", file=sys.stderr)
        return 1
    print(f"check passed: {sum(map(len, wheels.values()))} wheels, every requirement met, "
          f"all install for CPython 3.12 manylinux_2_28 x86_64 with no index")
    return 0


# -------------------------------------------------------------------------------------- install

def install(args) -> int:
    """pip-install every wheel of the bundle into TARGET only (never the system site-packages)."""
    left_out = {norm(n) for n in args.without.split(",") if n}
    wheels = [w.path for ws in bundle(args.dir).values() for w in ws if w.name not in left_out]
    target = Path(args.target).resolve()
    system = {Path(sysconfig.get_path(k)).resolve() for k in ("purelib", "platlib")}
    if not wheels:
        print(f"error: no wheels in {args.dir}; run fetch (online) and carry .whl/ along", file=sys.stderr)
        return 1
    if target in system:
        print(f"error: {target} is this Python's site-packages; give a folder of its own", file=sys.stderr)
        return 1
    target.mkdir(parents=True, exist_ok=True)
    r = pip("install", "--isolated", "--no-index", "--no-deps", "--find-links", str(args.dir),
            "--target", str(target), "--upgrade", "--no-compile", "--quiet", *map(str, wheels))
    if r.returncode:
        print(f"error: installing {len(wheels)} wheels from {args.dir} into {target} failed (pip exit "
              f"{r.returncode}, above). The bundle is for CPython 3.12 on x86_64 Linux; this is "
              f"{sys.implementation.name} {sys.version.split()[0]}.", file=sys.stderr)
        return 1
    for line in machine_gaps(args.dir, left_out):
        print(f"warning: {line}")
    print(f"installed {len(wheels)} wheels into {target}; use them with:")
    print(f"export PYTHONPATH={target}:$PYTHONPATH")
    return 0


def machine_gaps(folder: Path, left_out: set[str] = frozenset()) -> list[str]:
    """What the carried wheels need from this machine that it lacks, or has at another version.

    Run where the wheels are installed, so the ranges `check` could only assume are checked here.
    """
    from importlib.metadata import PackageNotFoundError, version
    wheels = {n: ws for n, ws in bundle(folder).items() if n not in left_out}
    gaps = []
    for ws in wheels.values():
        for w in ws:
            for r in (r for r in w.needs() if norm(r.name) not in wheels):
                try:
                    have = version(r.name)
                except PackageNotFoundError:
                    gaps.append(f"{w.name} {w.version} needs {r.name}{r.specifier}: not installed here")
                    continue
                if not admits(r.specifier, have):
                    gaps.append(f"{w.name} {w.version} needs {r.name}{r.specifier}: {have} here")
    return gaps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=WHEELS, help="the wheel folder (default: .whl/)")
    sub = parser.add_subparsers(dest="cmd", required=True)
    sub.add_parser("fetch", help="online: download and build the bundle into the folder")
    sub.add_parser("check", help="offline: the bundle is complete and installs on CPython 3.12")
    inst = sub.add_parser("install", help="on the GPU machine: install into TARGET")
    inst.add_argument("target")
    inst.add_argument("--without", default="", help="comma-separated names not to install (e.g. "
                      "transformers,peft: use the machine's own)")
    args = parser.parse_args(argv)
    return {"fetch": fetch, "check": check, "install": install}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

"""Loss goldens (torchtitan's idea): the loss curves of the demo's tiny model at a few layouts, recorded
in ``tests/assets/loss_goldens/<name>.json``, that every change must reproduce to the bit on CPU.

A golden holds, per step, the training loss, the grad norm and the learning rate, and the eval
losses, as JSON floats (Python writes and reads a double exactly), plus the platform it was recorded
on. Bits depend on that platform: the torch build and the libraries that order the sums (DeepSpeed,
megatron-core, transformers), the CPU's kernel family (``torch.backends.cpu.get_cpu_capability()``:
AVX2 and AVX512 kernels sum in different orders) and the threads per rank (the launcher gives each
rank ``cpu_count // nproc`` unless OMP_NUM_THREADS says otherwise; more threads split the reductions
differently). On another platform a golden fails, naming what differs and how to re-record it; it is
never skipped.

Re-record (on the CI machine type, with requirements/constraints.txt's pins), then commit the JSON files::

    python -m pytest -n 0 -k loss_golden --record-goldens \\
        tests/e2e/test_train_deepspeed.py tests/e2e/test_megatron_train.py tests/e2e/test_megatron_lora.py
"""
from __future__ import annotations

import json
import os
from importlib.metadata import version
from pathlib import Path

import pytest

GOLDENS = Path(__file__).resolve().parents[1] / "assets" / "loss_goldens"
RECORD_OPTION = "--record-goldens"
RECORD = ("python -m pytest -n 0 -k loss_golden --record-goldens tests/e2e/test_train_deepspeed.py "
          "tests/e2e/test_megatron_train.py tests/e2e/test_megatron_lora.py")
STEP_KEYS = ("loss", "grad_norm", "lr")


def platform(nproc: int) -> dict:
    """What the bits of a CPU run depend on, beside the code: library builds, kernels, rank threads."""
    import torch
    threads = os.environ.get("OMP_NUM_THREADS", "")
    return {"torch": torch.__version__, "deepspeed": version("deepspeed"), "megatron-core": version("megatron-core"),
            "transformers": version("transformers"), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "rank_threads": int(threads) if threads.isdigit() else max(1, (os.cpu_count() or 1) // nproc)}


def curve(run_dir: Path) -> dict:
    """The run's metrics.jsonl as a golden compares it: per step ``STEP_KEYS``, and the eval losses."""
    steps, evals = {}, {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            steps[r["step"]] = {k: r[k] for k in STEP_KEYS}
        if "eval_loss" in r:
            evals[r["step"]] = r["eval_loss"]
    return {"steps": [{"step": s, **steps[s]} for s in sorted(steps)],
            "eval": [{"step": s, "eval_loss": evals[s]} for s in sorted(evals)]}


def check_golden(request, name: str, run_dir: Path, overrides: list[str], nproc: int) -> None:
    """The run's curve equals golden ``name``'s bit for bit; with ``--record-goldens`` it becomes it.
    ``overrides`` and ``nproc`` (what the run was launched with, paths left out) are part of the golden:
    a golden of another configuration is refused, not compared."""
    path, here = GOLDENS / f"{name}.json", platform(nproc)
    got = curve(run_dir)
    if request.config.getoption(RECORD_OPTION):
        GOLDENS.mkdir(parents=True, exist_ok=True)
        record = {"name": name, "overrides": overrides, "nproc": nproc, "platform": here, **got}
        path.write_text(json.dumps(record, indent=1) + "\n")
        return
    if not path.exists():
        pytest.fail(f"loss golden {name} is missing ({path}); record it with: {RECORD}")
    want = json.loads(path.read_text())
    if (want["overrides"], want["nproc"]) != (overrides, nproc):
        pytest.fail(f"loss golden {name} was recorded for {want['overrides']} on {want['nproc']} ranks, this test runs "
                    f"{overrides} on {nproc}: re-record it with: {RECORD}")
    differs = {k: (want["platform"].get(k), v) for k, v in here.items() if want["platform"].get(k) != v}
    if differs:
        pytest.fail(f"loss golden {name} was recorded on another platform, so its bits cannot be compared here: "
                    + ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in differs.items())
                    + f". On the CI machine type with requirements/constraints.txt's pins, re-record with: {RECORD}")
    assert got == {"steps": want["steps"], "eval": want["eval"]}, _first_difference(name, got, want)


def _first_difference(name: str, got: dict, want: dict) -> str:
    for part in ("steps", "eval"):
        for g, w in zip(got[part], want[part]):
            for key in w:
                if g.get(key) != w[key]:
                    a, b = g.get(key), w[key]
                    gap = f"relative gap {abs(a - b) / abs(b):.1e}" if isinstance(a, float) and b else "differs"
                    return (f"loss golden {name}: step {w['step']} {key} is {a!r}, the golden {b!r} ({gap}). "
                            f"Unless the change means to alter the numbers (then re-record: {RECORD}), "
                            f"it changed the computation")
        if len(got[part]) != len(want[part]):
            return f"loss golden {name}: {len(got[part])} {part} records, the golden has {len(want[part])}"
    return f"loss golden {name} differs"


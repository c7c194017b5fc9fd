"""What a GPU test measured, beside the bound it checks: printed, and appended as one JSON line to
``$TOOLKIT_GPU_MEASURED`` when set (``benchmarks/gpu_check.py`` puts each value into results.json next
to the test's PASS/FAIL, so the first GPU run says how far inside its bounds every figure was)."""
from __future__ import annotations

import json
import os


def current_test() -> str:
    """``test_name[param]`` of the running test (pytest's PYTEST_CURRENT_TEST, xdist workers too)."""
    node = os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]
    return node.split("::")[-1]


def measure(name: str, value, bound=None):
    """Record ``value`` (and ``bound``) for the running test; returns ``value``."""
    print(f"\n[measured] {current_test()} {name}: {value}" + (f" (bound {bound})" if bound is not None else ""))
    path = os.environ.get("TOOLKIT_GPU_MEASURED")
    if path:
        line = json.dumps({"test": current_test(), "name": name, "measured": value, "bound": bound}, default=str)
        with open(path, "a") as f:  # one short write per line: xdist workers may append at once
            f.write(line + "\n")
    return value

"""Fixtures of the GPU layer, and the results stream ``benchmarks/gpu_check.py`` reads: with
``TOOLKIT_GPU_RESULTS`` set, every test collected and every test's outcome is appended there as one
JSON line the moment it is known, so a phase stopped at its time limit still says which tests
passed, failed, and never finished (pytest's junit XML is written only at the end)."""
from __future__ import annotations

import json
import os

import pytest
import torch

RESULTS_ENV = "TOOLKIT_GPU_RESULTS"


@pytest.fixture
def strict_fp32():
    """fp32 matmuls and convolutions with TF32 off, for the kernel tests that compare with float64."""
    if torch.cuda.is_available():
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def _stream(record: dict) -> None:
    path = os.environ.get(RESULTS_ENV)
    if path:
        with open(path, "a") as f:  # one short append per line: xdist's processes write side by side
            f.write(json.dumps(record) + "\n")


def pytest_collection_finish(session):
    """Every test collected (by each xdist worker alike; the reader takes the union)."""
    _stream({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report):
    """A test's outcome: a failure in any phase, a skip, or its call passing (xdist's controller and
    its worker both see it: the reader keeps one per test)."""
    if report.failed or report.skipped or report.when == "call":
        message = str(report.longrepr)[-1500:] if report.longrepr else ""
        if report.skipped and isinstance(report.longrepr, tuple):
            message = report.longrepr[2]
        _stream({"test": report.nodeid, "when": report.when, "outcome": report.outcome,
                 "seconds": round(report.duration, 2), "message": message})

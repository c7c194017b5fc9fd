"""glibc's mmap threshold, fixed so freed tensors of a few MB go back to the OS (``toolkit/heap.py``).

The setting is process-wide and cannot be undone, so what it does is probed in fresh processes
(``tests/helpers/heap.py``: whether glibc maps a 1, a 6 and a 16 MiB block after a 24 MiB free, which
with its dynamic threshold sends all three to the heap). That every rank applies it first thing is
``tests/distributed/test_heap_ranks.py``.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.runs import REPO, run_in_process, train_args
from toolkit.config import ConfigError
from toolkit.heap import DEFAULT_MMAP_THRESHOLD, THRESHOLD_ENV, mmap_threshold

glibc = pytest.mark.skipif(not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ,
                           reason="glibc's allocator (mallinfo2), its dynamic threshold not set by the environment")


def test_the_threshold_comes_from_the_environment():
    assert mmap_threshold({}) == DEFAULT_MMAP_THRESHOLD == 4 * 2**20
    sizes = {"8M": 8 << 20, "8MiB": 8 << 20, "512K": 512 << 10, "512kib": 512 << 10, "4194304": 4 << 20,
             " 32M ": 32 << 20, "": DEFAULT_MMAP_THRESHOLD}
    assert {raw: mmap_threshold({THRESHOLD_ENV: raw}) for raw in sizes} == sizes
    assert [mmap_threshold({THRESHOLD_ENV: raw}) for raw in ("0", "off", "OFF", "false", "no")] == [None] * 5


@pytest.mark.parametrize("raw,message", [("lots", "is not a size"), ("4G", "is not a size"), ("-1", "is not a size"),
                                         ("33M", "above glibc's limit of 33,554,432")])
def test_a_bad_threshold_names_the_variable_and_the_fix(raw, message):
    with pytest.raises(ConfigError, match=f"TOOLKIT_MMAP_THRESHOLD='{raw}' .*{message}.*0/off"):
        mmap_threshold({THRESHOLD_ENV: raw})


@glibc
@pytest.mark.parametrize("raw,threshold,mapped", [
    (None, DEFAULT_MMAP_THRESHOLD, {"1M": False, "6M": True, "16M": True}),  # the default: blocks from 4 MiB mapped
    ("8M", 8 << 20, {"1M": False, "6M": False, "16M": True}),  # tuned
    ("off", None, {"1M": False, "6M": False, "16M": False}),  # glibc's own: its threshold rose past all three
])
def test_glibc_maps_the_blocks_the_setting_names(raw, threshold, mapped):
    env = {k: v for k, v in os.environ.items() if k != THRESHOLD_ENV} | ({THRESHOLD_ENV: raw} if raw else {})
    out = subprocess.run([sys.executable, "-m", "tests.helpers.heap"], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out) == {"threshold": threshold, **mapped}


def test_toolkit_train_refuses_a_bad_threshold_before_launch(tmp_path):
    proc = run_in_process(train_args(tmp_path / "run", tmp_path / "cache"), env={THRESHOLD_ENV: "lots"}, check=False)
    assert proc.returncode == 2 and "TOOLKIT_MMAP_THRESHOLD='lots' is not a size" in proc.stderr
    assert not (tmp_path / "run" / "plan.json").exists()

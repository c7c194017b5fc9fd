"""Two "nodes" as two elastic agents on localhost (c10d rendezvous): same losses as one node."""
from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, TINY, losses

pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_agents_match_one_node(runs, tmp_path, data_cache):
    run_dir, port = tmp_path / "two_nodes", _free_port()
    procs = []
    for node in range(2):
        sets = [a for s in [*TINY, f"data.cache_dir={tmp_path / f'cache{node}'}", "checkpoint.every=3",
                            "zero.stage=2"] for a in ("--set", s)]
        cmd = [sys.executable, "-m", "toolkit", "train", "--run-dir", str(run_dir), "--nproc", "1",
               "--nnodes", "2", "--node-rank", str(node), "--rdzv-endpoint", f"127.0.0.1:{port}", *sets]
        procs.append(subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outputs)
    assert losses(run_dir) == pytest.approx(losses(runs("zero2", "zero.stage=2")), rel=1e-6)

"""What a GPU node must offer before `toolkit train` starts ranks (``toolkit/launch/devices.py``),
shown on the CPU with torch's CUDA queries faked: more local ranks than visible GPUs, and ranks
forked from a forkserver where CUDA is available, are refused before anything starts."""
from __future__ import annotations

import pytest
import torch

from tests.helpers.runs import refused, train_args
from toolkit.config import ConfigError
from toolkit.launch.devices import check_gpu_per_rank, rank_start_method

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="fakes the CUDA queries of a CPU machine")


@pytest.fixture
def gpus(monkeypatch):
    """``gpus(n)``: torch reports CUDA with ``n`` visible devices (the launcher asks nothing else)."""
    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
    return visible


def test_more_ranks_than_gpus_is_refused_before_launch(gpus, tmp_path, data_cache, monkeypatch):
    """Before: the job started, rank 1 died with "invalid device ordinal" and restarted."""
    gpus(1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    code, out, err = refused(train_args(tmp_path / "r", data_cache, nproc=2))
    assert code == 2, (out, err)
    assert ("--nproc 2 (config key nproc) starts 2 ranks on this node, but it sees 1 GPU "
            "(CUDA_VISIBLE_DEVICES='0')") in err
    assert "use --nproc 1, or make 2 GPUs visible" in err
    assert "toolkit: deepspeed on" not in out and not (tmp_path / "r" / "plan.json").exists()


def test_gpu_count_check_passes_what_fits(gpus):
    check_gpu_per_rank(8)  # no CUDA: CPU ranks, any number
    gpus(2)
    check_gpu_per_rank(2)
    check_gpu_per_rank(1)
    with pytest.raises(ConfigError, match=r"sees 2 GPUs .*use --nproc 2, or make 3 GPUs visible"):
        check_gpu_per_rank(3)


def test_forkserver_is_refused_where_cuda_is_available(gpus, tmp_path, data_cache, monkeypatch):
    monkeypatch.setenv("TOOLKIT_RANK_START", "forkserver")
    assert rank_start_method() == "forkserver"  # a CPU machine: its default, and allowed
    gpus(2)
    code, out, err = refused(train_args(tmp_path / "r", data_cache, nproc=1))
    assert code == 2, (out, err)
    assert "TOOLKIT_RANK_START=forkserver: this machine has CUDA" in err and "set it to spawn" in err
    assert "toolkit: deepspeed on" not in out
    monkeypatch.delenv("TOOLKIT_RANK_START")
    assert rank_start_method() == "spawn"  # CUDA's default


def test_free_port_is_drawn_below_the_ephemeral_range_and_skips_a_listening_one(monkeypatch):
    """A rendezvous port from ``bind(0)`` lies in the range outgoing connections take their local
    ports from, so another job's connection could take it before a rank listens (EADDRINUSE, seen in
    CI); the port is drawn below that range, and one something listens on is never handed out."""
    import random
    import socket

    from toolkit import parallel
    low = parallel._ephemeral_range_start()
    assert all(10000 <= parallel.free_port() < low for _ in range(20))
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        taken = listening.getsockname()[1]
        draws = iter([taken, 20001])
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, a, b: next(draws))
        monkeypatch.setattr(parallel, "_ephemeral_range_start", lambda: 65000)
        assert parallel.free_port() == 20001

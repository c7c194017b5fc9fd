"""What this node must offer before ``toolkit train`` starts its ranks: a GPU of its own for each
local rank, and a way of starting ranks that is safe where CUDA is present. Checked in the
launcher, so a job the machine cannot run is refused in seconds and starts nothing."""
from __future__ import annotations

import os

import torch

from toolkit.config import ConfigError

RANK_START_ENV = "TOOLKIT_RANK_START"
RANK_STARTS = ("spawn", "forkserver")


def check_gpu_per_rank(nproc: int) -> None:
    """With CUDA, each of the ``nproc`` local ranks takes GPU ``LOCAL_RANK``: fewer visible GPUs
    would start anyway, rank ``nproc - 1`` failing with "invalid device ordinal" and restarting,
    and NCCL refuses two ranks on one GPU. Without CUDA ranks run on the CPU (gloo), any number."""
    if not torch.cuda.is_available():
        return
    visible = torch.cuda.device_count()
    if nproc > visible:
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f"CUDA_VISIBLE_DEVICES={mask!r}" if mask is not None else "CUDA_VISIBLE_DEVICES unset"
        raise ConfigError(f"--nproc {nproc} (config key nproc) starts {nproc} ranks on this node, but it sees "
                          f"{visible} GPU{'s' if visible != 1 else ''} ({shown}); each rank needs a GPU of its own "
                          f"(NCCL refuses two ranks on one GPU): use --nproc {visible}, or make {nproc} GPUs "
                          "visible")


def rank_start_method() -> str:
    """How local ranks start: ``spawn`` (a fresh ``python -m toolkit.train.worker`` each) or
    ``forkserver`` (forked from a process that imported the backend once: CPU machines only).
    ``TOOLKIT_RANK_START`` chooses; by default spawn with CUDA, forkserver without."""
    cuda = torch.cuda.is_available()
    start = os.environ.get(RANK_START_ENV) or ("spawn" if cuda else "forkserver")
    if start not in RANK_STARTS:
        raise ConfigError(f"{RANK_START_ENV}={start!r}: choose spawn or forkserver")
    if start == "forkserver" and cuda:
        raise ConfigError(f"{RANK_START_ENV}=forkserver: this machine has CUDA, and ranks forked from a shared "
                          "process cannot use it safely (CUDA state does not survive a fork); unset "
                          f"{RANK_START_ENV} or set it to spawn")
    return start

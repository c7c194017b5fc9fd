"""Process-group setup, environment from the common launchers, seeding and RNG state.

Works the same when ranks come from our own elastic launcher, torchrun, the deepspeed launcher
(RANK/WORLD_SIZE/MASTER_ADDR set) or Slurm's srun (SLURM_* mapped here).
"""
from __future__ import annotations

import hashlib
import os
import random
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist


def launched_externally(own_rendezvous: bool = False) -> bool:
    """True when a launcher already made us one rank of a job (torchrun, deepspeed, srun).

    ``own_rendezvous``: the command names its own ``--rdzv-endpoint``, so this process is a node's
    agent that starts the ranks itself, even where the scheduler exports per-task variables that
    look like a rank's (srun with one task per node sets SLURM_PROCID; a PyTorchJob sets RANK to
    the pod's index). Only a torchrun-started rank (TORCHELASTIC_RUN_ID) is a rank regardless.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return True
    if own_rendezvous:
        return False
    return "RANK" in os.environ or "SLURM_PROCID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def adopt_slurm_env() -> None:
    """Map srun's task variables to torch's, once; MASTER_ADDR/PORT must come from the job script."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ:
        return
    for missing in ("MASTER_ADDR", "MASTER_PORT"):
        if missing not in os.environ:
            raise RuntimeError(f"running under srun without {missing}; export it in the sbatch script "
                               "(see examples/slurm/), e.g. MASTER_ADDR=$(scontrol show hostnames | head -1)")
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ["SLURM_NTASKS"]
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")


def local_world_size() -> int:
    """Ranks on this node, as the launcher says: torchrun (LOCAL_WORLD_SIZE), the deepspeed launcher
    (LOCAL_SIZE), srun (SLURM_NTASKS_PER_NODE, else SLURM_NTASKS / SLURM_NNODES); 1 if none does."""
    env = os.environ
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE", "SLURM_NTASKS_PER_NODE"):
        if env.get(key, "").isdigit():
            return int(env[key])
    if env.get("SLURM_NTASKS", "").isdigit():
        return max(1, int(env["SLURM_NTASKS"]) // int(env.get("SLURM_NNODES", "1") or 1))
    return 1


def share_cores() -> None:
    """Give this rank its share of the node's cores, unless OMP_NUM_THREADS says otherwise. torchrun
    and the toolkit's launcher set it; the deepspeed launcher and srun do not, and each rank's torch
    would then use every core: oversubscribed, and with matmul reductions (hence losses, ~1e-8)
    that depend on which launcher started the job."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    threads = max(1, (os.cpu_count() or 1) // local_world_size())
    os.environ["OMP_NUM_THREADS"] = str(threads)
    torch.set_num_threads(threads)


def comm_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_process_group(timeout_s: float = 600) -> None:
    """Join the job's default process group (env:// rendezvous) on the right device."""
    adopt_slurm_env()
    share_cores()
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    if not dist.is_initialized():
        timeout = timedelta(seconds=timeout_s)
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(comm_backend(), timeout=timeout)
        else:
            dist.init_process_group(comm_backend(), timeout=timeout, store=store,
                                    rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))


def _attempt_store(timeout: timedelta):
    """Under torch elastic the agent's TCP store outlives a restart; without a per-attempt prefix the
    new ranks read the dead ranks' gloo addresses and hang connecting to them."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                           timeout=timeout)
    return dist.PrefixStore(f"toolkit/attempt_{attempt}", client)


def free_port() -> int:
    """A TCP port that nothing listens on now, for a rendezvous or a store to listen on shortly.

    Drawn below the kernel's ephemeral range rather than from ``bind(0)``: ``bind(0)`` hands out a
    port of that range, where every outgoing connection on the machine (gloo's pairs, a TCP
    store's clients) also takes its local port, so between picking the port and listening on it a
    connection of another job could take it (EADDRINUSE, seen in CI with two test workers)."""
    import socket
    low = _ephemeral_range_start()
    draw = random.SystemRandom()
    for _ in range(200 if low > 11000 else 0):
        port = draw.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no room below the ephemeral range: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ephemeral_range_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts there


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def unit_seed(seed: int, unit: str) -> int:
    """The seed of one named unit's init (a piece of the HF model, the LoRA adapters) under the run's
    ``seed``: the same on every rank, whatever else the rank builds."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{unit}".encode()).digest()[:8], "little") & (2**63 - 1)


def rng_state() -> dict:
    """This rank's RNG states in a form ``torch.load(weights_only=True)`` accepts."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": random.getstate(),
             "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])

"""Start N local ranks (or this node's share of a multi-node job) through torch's elastic agent.

This is the machinery behind torchrun (c10d rendezvous, worker monitoring, restarts), driven from
Python so that ``toolkit train`` needs no wrapper script.
"""
from __future__ import annotations

import os
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path


@dataclass
class LaunchSpec:
    nproc: int
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    run_id: str | None = None
    max_restarts: int = 0


def launch_workers(spec: LaunchSpec, config_path: Path, extra_env: dict[str, str] | None = None) -> None:
    """Run ``python -m toolkit.worker CONFIG`` on ``spec.nproc`` local ranks; raises on failure."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    single_node = spec.nnodes == 1 and spec.rdzv_endpoint is None
    config = LaunchConfig(
        min_nodes=spec.nnodes, max_nodes=spec.nnodes, nproc_per_node=spec.nproc,
        run_id=spec.run_id or (uuid.uuid4().hex if single_node else "toolkit"),
        rdzv_backend="c10d",
        # Like torchrun --standalone: a private store on a free loopback port.
        rdzv_endpoint="127.0.0.1:0" if single_node else spec.rdzv_endpoint,
        rdzv_configs={"rank": spec.node_rank} if not single_node else {},
        max_restarts=spec.max_restarts, monitor_interval=0.2, start_method="spawn",
        local_addr="127.0.0.1" if single_node else None,
    )
    _set_thread_env(spec.nproc)
    os.environ.update(extra_env or {})
    elastic_launch(config, sys.executable)("-u", "-m", "toolkit.worker", str(config_path))


def _set_thread_env(nproc: int) -> None:
    """Split the cores between local ranks unless the user chose (torchrun sets 1 per rank)."""
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))

"""Which nodes of a multi-node job reached the rendezvous: the name of a node that never joined.

torch's c10d rendezvous knows its participants only as ``host_pid_id`` and, when too few join,
raises a bare ``RendezvousTimeoutError`` after its join timeout (600 s by default). Each of our
agents writes its node rank, host and pid into the rendezvous store as it arrives
(``toolkit/roster/<node rank>``), so a node whose rendezvous times out can say which node ranks
never arrived, which arrived once and are gone (a node lost since an earlier round), and which
joined, and it gives up after ``join_timeout_s`` (seconds, not ten minutes).
"""
from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass

JOIN_BASE_S = 60.0
"""Agents of one job start within seconds of each other (one srun, one JobSet), then each tokenizes
from the shared data cache before it joins: a minute covers that skew on small clusters..."""
JOIN_PER_NODE_S = 0.25
"""...and the c10d rendezvous itself slows with the node count (every node polls and rewrites one
shared state: ~0.1-0.3 s per node at thousands of nodes), so 2,000 nodes get torch's 600 s."""
ROSTER_KEY = "toolkit/roster/"
KEEP_ALIVE_MISSES = 3  # torch's keep_alive_max_attempt: beats missed before a node counts as dead


def keep_alive_s(nnodes: int) -> int:
    """How often each agent beats the rendezvous state. A node lost mid-run stays a participant of the
    finished round, holding the survivors out of the next one, until it has missed
    ``KEEP_ALIVE_MISSES`` beats: torch's 5 s made that 15 s of each elastic recovery (measured: 25.6 s
    from the failure to the next rendezvous, 10 s of it the last call). Every beat rewrites one
    shared state, so large jobs keep torch's interval: 1 s up to 31 nodes, then 1 s more per 16 nodes,
    5 s (torch's) from 80 nodes."""
    return min(5, max(1, nnodes // 16))


def join_timeout_s(nnodes: int, configured: float | None = None) -> float:
    """How long a node waits at the rendezvous for the others: ``restart.join_timeout_s``, or
    ``JOIN_BASE_S + JOIN_PER_NODE_S x nnodes``."""
    if configured is not None:
        return float(configured)
    return JOIN_BASE_S + JOIN_PER_NODE_S * nnodes


@dataclass
class Roster:
    """This node's place in the job and a client of the rendezvous store (None until connected)."""

    nnodes: int
    node_rank: int
    endpoint: str
    timeout_s: float
    store: object | None = None

    def connect(self) -> None:
        """Connect to the rendezvous store (node 0's, listening by now) and say this node arrived."""
        from datetime import timedelta

        import torch.distributed as dist
        host, _, port = self.endpoint.rpartition(":")
        self.store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=30))
        self.store.set(f"{ROSTER_KEY}{self.node_rank}",
                       json.dumps({"node": self.node_rank, "host": socket.gethostname(), "pid": os.getpid()}))

    def arrived(self) -> dict[int, dict]:
        """Node rank -> {host, pid} of every node that ever reached this rendezvous."""
        if self.store is None:
            return {}
        seen = {}
        for node in range(self.nnodes):
            key = f"{ROSTER_KEY}{node}"
            try:
                if self.store.check([key]):
                    seen[node] = json.loads(self.store.get(key))
            except Exception:  # noqa: BLE001 - the store's host (node 0) may be the one that is gone
                break
        return seen

    def absent(self, participants: list[tuple[str, int]] | None) -> tuple[list[int], list[int], list[int]]:
        """(never arrived, arrived once and gone, joined) node ranks of a round that timed out.
        ``participants``: (host, agent pid) of the nodes in that round (this node excluded), None
        when torch's state could not be read (then only the nodes that never arrived are named)."""
        arrived = self.arrived()
        joined = {self.node_rank}
        if participants is not None:
            pids = {pid for _, pid in participants}
            joined |= {n for n, a in arrived.items() if a["pid"] in pids}
        never = [n for n in range(self.nnodes) if n not in arrived and n != self.node_rank]
        gone = sorted(n for n in arrived if n not in joined) if participants is not None else []
        return never, gone, sorted(joined)

    def timed_out(self, participants: list[tuple[str, int]] | None, min_nodes: int) -> str:
        """The error of a rendezvous that did not complete within ``timeout_s``, naming the nodes."""
        never, gone, joined = self.absent(participants)
        arrived = self.arrived()
        parts = []
        if never:
            parts.append(f"node(s) {_ranks(never)} never reached it")
        if gone:
            parts.append("node(s) " + ", ".join(f"{n} ({arrived[n]['host']}, agent pid {arrived[n]['pid']})"
                                                for n in gone) + " joined an earlier round and are gone")
        present = ", ".join(f"{n} ({arrived.get(n, {}).get('host', socket.gethostname())})" for n in joined)
        missing = "; ".join(parts) or "the other nodes did not join"
        return (f"the rendezvous at {self.endpoint} did not complete in {self.timeout_s:.0f} s: {missing}; "
                f"joined: node(s) {present}, {len(joined)} of {self.nnodes} (at least {min_nodes} needed). "
                f"Look at the missing node's log (did its toolkit train start, with --node-rank and this "
                f"--rdzv-endpoint?); to wait longer for slow starts, raise restart.join_timeout_s")


def participants(rdzv_handler) -> list[tuple[str, int]] | None:
    """(host, pid) of the nodes in the handler's last-seen round, or None when this torch's
    handler does not expose them (the error then names only the nodes that never arrived)."""
    state = getattr(getattr(rdzv_handler, "_state_holder", None), "state", None)
    members = getattr(state, "participants", None)
    if members is None:
        return None
    return [(node.addr, node.pid) for node in members if node.pid != os.getpid()]


def _ranks(nodes: list[int]) -> str:
    return ", ".join(str(n) for n in nodes)


def whole_seconds(seconds: float) -> int:
    """torch's rendezvous reads its timeouts as whole seconds."""
    return max(1, math.ceil(seconds))

"""The roster of a multi-node rendezvous (``toolkit/launch/roster.py``): the join timeout's rule, and
which nodes a timed-out round names as never arrived, lost since an earlier round, or joined."""
from __future__ import annotations

import json

from toolkit.launch.roster import ROSTER_KEY, Roster, join_timeout_s, keep_alive_s


class DictStore:
    """The two calls the roster makes of a c10d store."""

    def __init__(self, nodes: dict[int, dict]):
        self.keys = {f"{ROSTER_KEY}{n}": json.dumps(v).encode() for n, v in nodes.items()}

    def check(self, keys):
        return all(k in self.keys for k in keys)

    def get(self, key):
        return self.keys[key]


def test_the_join_timeout_scales_with_the_node_count_and_can_be_set():
    assert join_timeout_s(2) == 60.5
    assert join_timeout_s(2048) == 572  # torch's default, 600 s, is sized for clusters this large
    assert join_timeout_s(2, configured=3) == 3
    assert [keep_alive_s(n) for n in (1, 2, 31, 32, 64, 1000)] == [1, 1, 1, 2, 4, 5]  # torch's 5 s at scale


def test_a_timed_out_round_names_the_nodes_never_arrived_lost_and_joined():
    roster = Roster(nnodes=4, node_rank=0, endpoint="node0:29400", timeout_s=61)
    roster.store = DictStore({0: {"host": "a", "pid": 10}, 1: {"host": "b", "pid": 11},
                              2: {"host": "c", "pid": 12}})
    # node 1 is in this round; node 2 arrived in an earlier round (pid 12) and is gone; node 3 never came
    assert roster.absent([("b", 11)]) == ([3], [2], [0, 1])
    message = roster.timed_out([("b", 11)], min_nodes=4)
    assert "did not complete in 61 s: node(s) 3 never reached it; node(s) 2 (c, agent pid 12) joined an " \
           "earlier round and are gone; joined: node(s) 0 (a), 1 (b), 2 of 4 (at least 4 needed)" in message
    assert "restart.join_timeout_s" in message
    # torch's state unreadable: only the nodes that never arrived can be named
    assert roster.absent(None) == ([3], [], [0])

"""Every rank fixes glibc's mmap threshold first thing (``train/worker.py::run_worker``, ``toolkit/heap.py``),
from its environment: the default, a tuned value and ``off``, one per rank of a 3-rank job forked from
the forkserver the launcher uses, each probed from inside the rank (``tests/helpers/heap.py``). The
rank entry is stopped right after the setting: its plan raises at the first look."""
from __future__ import annotations

import os

from tests.helpers.heap import mapped_blocks
from tests.helpers.ranks import run_ranks
from toolkit.heap import THRESHOLD_ENV

SETTINGS = (None, "8M", "off")  # rank r's TOOLKIT_MMAP_THRESHOLD (None: unset)


class _Stop(Exception):
    pass


class _Unread:
    """A plan the rank entry stops at: anything it reads raises ``_Stop``."""

    def __getattr__(self, name):
        raise _Stop(name)


def _rank(rank: int, world: int) -> dict:
    from toolkit.train.worker import run_worker
    os.environ.pop(THRESHOLD_ENV, None)
    if SETTINGS[rank] is not None:
        os.environ[THRESHOLD_ENV] = SETTINGS[rank]
    try:
        run_worker(_Unread())
    except _Stop:
        pass
    return mapped_blocks()


def test_each_rank_applies_its_environments_threshold(tmp_path):
    assert run_ranks(_rank, 3, tmp_path) == [{"1M": False, "6M": True, "16M": True},
                                             {"1M": False, "6M": False, "16M": True},
                                             {"1M": False, "6M": False, "16M": False}]

"""The fault injector's checkpoint faults, without a job: each raises what a real failure would, at
its point, once per run directory; and the error a failed save reports names the rank and the errno."""
from __future__ import annotations

import errno

import pytest

from toolkit.checkpoint.manager import SaveFailed
from toolkit.storage.space import describe_error
from toolkit.watch.faults import FaultInjector


def test_enospc_and_raise_in_persist_fire_at_their_step_once(tmp_path):
    hooks = FaultInjector(tmp_path, rank=1, spec="enospc:step=4:rank=1;raise_in_persist:step=6:rank=1")
    hooks.in_save(2)  # another step: nothing
    with pytest.raises(OSError) as full:
        hooks.in_save(4)
    assert full.value.errno == errno.ENOSPC
    with pytest.raises(RuntimeError, match="injected fault persisting step 6 on rank 1"):
        hooks.in_persist(6)
    again = FaultInjector(tmp_path, rank=1, spec="enospc:step=4:rank=1;raise_in_persist:step=6:rank=1")
    again.in_save(4)  # a restarted job does not trip over them again
    again.in_persist(6)
    FaultInjector(tmp_path / "other", rank=0, spec="enospc:step=4:rank=1").in_save(4)  # rank 1's fault only


def test_a_failed_save_names_each_rank_and_its_errno():
    disk = describe_error(OSError(errno.ENOSPC, "No space left on device"))
    assert disk == "ENOSPC: [Errno 28] No space left on device"
    assert describe_error(RuntimeError("boom")) == "RuntimeError('boom')"
    failed = SaveFailed(4, [None, disk])
    assert str(failed) == f"checkpoint step 4 could not be written (rank 1: {disk})"

"""The hang watchdog's reading of dumped stacks (faulthandler's format), on the two shapes a rank of
a forked job dumps: stuck in its own code, or waiting in a collective for the stuck one."""
from toolkit.launch.agent import _waiting_in_collective

WRAPPERS = """\
  File "/venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py", line 706 in _wrap
  File "/venv/lib/python3.11/site-packages/torch/multiprocessing/spawn.py", line 87 in _wrap
  File "/usr/lib/python3.11/multiprocessing/forkserver.py", line 274 in main
"""
OTHER_THREAD = """\
Thread 0x00007f2368ad66c0 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 1 in background
"""
STUCK = OTHER_THREAD + """\
Current thread 0x00007f23af7fab80 (most recent call first):
  File "/repo/toolkit/watch/faults.py", line 77 in after_step
  File "/repo/toolkit/train/trainer.py", line 91 in fit
  File "/repo/toolkit/train/worker.py", line 86 in forked_main
""" + WRAPPERS
WAITING = """\
Current thread 0x00007f23af7fab80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/repo/toolkit/watch/monitor.py", line 58 in stop_agreed
  File "/repo/toolkit/train/worker.py", line 86 in forked_main
""" + WRAPPERS


def test_only_the_ranks_own_frames_count():
    assert not _waiting_in_collective(STUCK)  # the wrappers and other threads are not its frames
    assert _waiting_in_collective(WAITING)
    spawned = "Stack (most recent call first):\n" + WAITING.split("\n", 1)[1].replace(WRAPPERS, "")
    assert _waiting_in_collective(spawned)


def test_every_noted_exit_is_reported_not_only_the_one_torch_saw():
    """torch's process context for function ranks reports one failed rank; the agent adds every rank
    it noted exiting with an error (here: torch saw rank 0 fail in a collective after rank 1's SIGKILL)."""
    from types import SimpleNamespace

    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from toolkit.launch.agent import ToolkitAgent
    agent = ToolkitAgent.__new__(ToolkitAgent)  # only the bookkeeping under test, no rendezvous
    agent._exits = {0: (100, 1), 1: (101, -9)}
    agent._pcontext = SimpleNamespace(error_files={0: "/e0", 1: "/e1"})
    group = SimpleNamespace(workers=[SimpleNamespace(global_rank=2), SimpleNamespace(global_rank=3)])
    seen = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file="/e0")
    result = RunResult(state=WorkerState.FAILED, failures={2: seen})
    agent._add_noted_failures(group, result)
    assert result.failures[2] is seen  # torch's own record kept
    assert (result.failures[3].local_rank, result.failures[3].pid, result.failures[3].exitcode) == (1, 101, -9)

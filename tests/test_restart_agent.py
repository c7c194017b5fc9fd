"""The hang watchdog's reading of dumped stacks (faulthandler's format), on the two shapes a rank of
a forked job dumps: stuck in its own code, or waiting in a collective for the stuck one."""
from toolkit.restart.agent import _waiting_in_collective

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
  File "/repo/toolkit/restart/faults.py", line 77 in after_step
  File "/repo/toolkit/trainer.py", line 91 in fit
  File "/repo/toolkit/worker.py", line 86 in forked_main
""" + WRAPPERS
WAITING = """\
Current thread 0x00007f23af7fab80 (most recent call first):
  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/repo/toolkit/restart/monitor.py", line 58 in stop_agreed
  File "/repo/toolkit/worker.py", line 86 in forked_main
""" + WRAPPERS


def test_only_the_ranks_own_frames_count():
    assert not _waiting_in_collective(STUCK)  # the wrappers and other threads are not its frames
    assert _waiting_in_collective(WAITING)
    spawned = "Stack (most recent call first):\n" + WAITING.split("\n", 1)[1].replace(WRAPPERS, "")
    assert _waiting_in_collective(spawned)

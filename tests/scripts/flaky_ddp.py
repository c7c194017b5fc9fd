"""A plain torchrun-style script (not our trainer) for `toolkit supervise` tests: all-reduces a
counter for a few steps, beats the heartbeat, and crashes rank 1 once on the first attempt."""
import os
import sys

import torch
import torch.distributed as dist

from toolkit.watch.heartbeat import beat

dist.init_process_group("gloo")
rank = dist.get_rank()
first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
for step in range(1, 6):
    t = torch.ones(1)
    dist.all_reduce(t)
    beat(step)
    if step == 3 and rank == 1 and first_attempt:
        sys.exit(13)
print(f"rank {rank} done, attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')}", flush=True)
dist.destroy_process_group()

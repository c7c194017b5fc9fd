"""CPU Adam trajectories for tests/e2e/test_cpu_adam_resume.py, one process per segment (the C++
kernel's state lives in the process, as it does across a real restart).

usage: cpu_adam_resume.py full OUT        30 steps from scratch; also saves the state after step 13
       cpu_adam_resume.py resume OUT REPLAY(0|1)   steps 14..30 from that saved state
"""
import sys
from pathlib import Path

import torch
from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

from toolkit.adapters.deepspeed.optimizer import replay_cpu_adam_step_counter

STEPS, SAVE_AT = 30, 13  # 0.9**14 and 0.95**14 round differently as a running product and as pow()


def trajectory(cls, out: Path, start: int, replay: bool):
    gen = torch.Generator().manual_seed(0)
    param = torch.nn.Parameter(torch.randn(4096, generator=gen))
    grads = [torch.randn(4096, generator=gen) for _ in range(STEPS)]
    opt = cls([param], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    if start:
        saved = torch.load(out / f"{cls.__name__}_at_{start}.pt")
        param.data.copy_(saved["param"])
        opt.load_state_dict(saved["optimizer"])
        if replay:
            replay_cpu_adam_step_counter(opt)
    for step in range(start, STEPS):
        if step == SAVE_AT and not start:
            torch.save({"param": param.detach().clone(), "optimizer": opt.state_dict()},
                       out / f"{cls.__name__}_at_{step}.pt")
        param.grad = grads[step].clone()
        opt.step()
    return param.detach()


if __name__ == "__main__":
    mode, out = sys.argv[1], Path(sys.argv[2])
    replay = len(sys.argv) > 3 and sys.argv[3] == "1"
    start = 0 if mode == "full" else SAVE_AT
    final = {cls.__name__: trajectory(cls, out, start, replay) for cls in (FusedAdam, DeepSpeedCPUAdam)}
    torch.save(final, out / f"{mode}_{int(replay)}.pt")

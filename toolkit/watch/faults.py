"""Fault injector for tests and soak runs; inert unless ``TOOLKIT_FAULT`` is set.

``TOOLKIT_FAULT="KIND:step=S[:rank=R][:...]"``, several separated by ``;``. Kinds:
  kill      SIGKILL this rank after step S
  hang      sleep forever at step S (the watchdog must catch it)
  raise     raise RuntimeError after step S
  sigterm   send SIGTERM to this rank after step S (preemption)
  abort     ``os.abort()`` (SIGABRT, no core file) in the middle of step S: in its first backward
  sigint    send SIGINT (Ctrl-C) to this rank in the middle of step S (preemption, as SIGTERM)
  kill_in_save  SIGKILL while writing the checkpoint of step S (after the engine files)
  kill_in_persist  SIGKILL while the background writer persists the checkpoint of step S (async saves;
                   fires on the node's local rank 0, which runs that writer)
  raise_in_persist  raise RuntimeError in that background writer while it persists step S
  enospc    raise OSError(ENOSPC) while this rank writes the checkpoint of step S (after the engine
            files; asynchronous saves: while writing the node-local snapshot): a full disk
  corrupt   after committing the checkpoint of step S, flip one byte in it (rank 0)
  slow      sleep ``ms`` milliseconds in every step from S on (a straggler)
  slow_eval, slow_save, slow_export  sleep ``ms`` milliseconds after each unit of that phase's work
            at step S (an eval micro-batch, a checkpoint file, an exported tensor; export runs at the
            last step): long healthy work that beats as it goes (every time, not once)
  hang_in_save  sleep forever while writing the checkpoint of step S (after the engine files)
  hang_in_load  sleep forever while resuming the checkpoint of step S (after the engine loaded it)
  hang_in_step  sleep forever in step S, before its forward (a step that hangs, e.g. after an eval or a save)
  diverge   perturb one parameter on this rank after step S (replicas drift apart)
  overflow  make step S's gradients infinite on this rank (fp16: the loss scaler must skip the step)
  host_collective  all-reduce a tensor made without ``device=`` after step S (strict device mode
            refuses it: how a test sees that a real rank runs strict; set it on every rank)
Each fault fires once per run directory (``RUN_DIR/faults_fired``), so a restarted job does not
trip over the same fault again.
"""
from __future__ import annotations

import errno
import os
import resource
import signal
import time
from pathlib import Path

FAULT_KINDS = {"kill", "hang", "raise", "sigterm", "kill_in_save", "kill_in_persist", "corrupt", "slow", "diverge",
               "overflow", "host_collective", "slow_eval", "slow_save", "slow_export", "hang_in_save", "hang_in_load",
               "hang_in_step", "abort", "sigint", "raise_in_persist", "enospc"}


def parse(spec: str) -> list[dict]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, *fields = item.split(":")
        if kind not in FAULT_KINDS:
            raise ValueError(f"TOOLKIT_FAULT={spec!r}: unknown fault {kind!r}; known: {sorted(FAULT_KINDS)}")
        fault = {"kind": kind, "rank": 0}
        for f in fields:
            key, _, value = f.partition("=")
            fault[key] = int(value)
        if "step" not in fault:
            raise ValueError(f"TOOLKIT_FAULT={spec!r}: {kind} needs step=N")
        faults.append(fault)
    return faults


class FaultInjector:
    """The loop's hooks at named points (``before_step``, ``after_step``, ``in_save``, ``in_persist``,
    ``after_commit``); each fires the faults set for this rank at that point, once per run dir."""

    def __init__(self, run_dir: Path, rank: int, spec: str | None = None, params=None):
        """``params``: a callable giving this rank's parameters (for ``diverge`` and ``overflow``)."""
        spec = os.environ.get("TOOLKIT_FAULT", "") if spec is None else spec
        self.faults = [f for f in parse(spec) if f["rank"] == rank]
        self.fired_file = Path(run_dir) / "faults_fired"
        self.rank, self.params = rank, params

    def _take(self, kind: str, step: int) -> dict | None:
        for f in self.faults:
            if f["kind"] == kind and f["step"] == step and not self._fired(f):
                self._mark(f)
                return f
        return None

    def _key(self, f: dict) -> str:
        return f"{f['kind']}:{f['step']}:{f['rank']}"

    def _fired(self, f: dict) -> bool:
        return self.fired_file.exists() and self._key(f) in self.fired_file.read_text().split()

    def _mark(self, f: dict) -> None:
        with open(self.fired_file, "a") as out:
            out.write(self._key(f) + "\n")
            out.flush()
            os.fsync(out.fileno())

    def after_step(self, step: int) -> None:
        if not self.faults:
            return
        if self._take("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._take("hang", step):
            _sleep_forever()
        if self._take("raise", step):
            raise RuntimeError(f"injected fault at step {step} on rank {self.rank}")
        if self._take("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)
        if self._take("host_collective", step):
            import torch
            import torch.distributed as dist
            dist.all_reduce(torch.zeros(1))  # on the host: NCCL would fail, strict mode must too
        if self.params is not None and self._take("diverge", step):
            import torch
            with torch.no_grad():
                next(p for p in self.params() if p.numel() > 0).add_(1e-3)

    def before_step(self, step: int) -> None:
        if not self.faults:
            return
        for f in self.faults:  # every step from S on
            if f["kind"] == "slow" and step >= f["step"]:
                time.sleep(f.get("ms", 200) / 1000)
        if self._take("hang_in_step", step):
            _sleep_forever()
        if self.params is not None and self._take("overflow", step):
            self._overflow_gradients()
        if self.params is not None and self._take("abort", step):
            self._in_first_backward(_abort)
        if self.params is not None and self._take("sigint", step):
            self._in_first_backward(lambda: os.kill(os.getpid(), signal.SIGINT))

    def _in_first_backward(self, action) -> None:
        """``action()`` once, when the first backward of the step reaches a parameter: mid-step, with
        the forward done and the gradients half made."""
        param = next(p for p in self.params() if p.requires_grad and p.numel() > 0)
        handle = None

        def fire(grad):
            handle.remove()
            action()
            return grad

        handle = param.register_hook(fire)

    def _overflow_gradients(self) -> None:
        param = next(p for p in self.params() if p.requires_grad and p.numel() > 0)
        handle = None

        def to_inf(grad):  # once: the first backward of the step (inf survives accumulation)
            handle.remove()
            return grad * float("inf")

        handle = param.register_hook(to_inf)

    def in_save(self, step: int) -> None:
        if self.faults and self._take("kill_in_save", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults and self._take("hang_in_save", step):
            _sleep_forever()
        if self.faults and self._take("enospc", step):
            raise OSError(errno.ENOSPC, f"No space left on device (injected while writing step {step})")

    def in_load(self, step: int) -> None:
        """Called once the engine loaded the checkpoint of ``step``, before the rank goes on."""
        if self.faults and self._take("hang_in_load", step):
            _sleep_forever()

    def in_progress(self, phase: str, step: int) -> None:
        """Called after each unit of a phase's work (``Trainer._phase``)."""
        for f in self.faults:
            if f["kind"] == f"slow_{phase}" and f["step"] == step:
                time.sleep(f.get("ms", 200) / 1000)

    def in_persist(self, step: int | None) -> None:
        """Called by the background writer after each file it persisted."""
        if self.faults and step is not None and self._take("kill_in_persist", step):
            os.kill(os.getpid(), signal.SIGKILL)
        if self.faults and step is not None and self._take("raise_in_persist", step):
            raise RuntimeError(f"injected fault persisting step {step} on rank {self.rank}")

    def after_commit(self, step: int, ckpt: Path) -> None:
        if self.faults and self._take("corrupt", step):
            victim = max((p for p in ckpt.rglob("*.pt") if p.is_file()), key=lambda p: p.stat().st_size)
            data = bytearray(victim.read_bytes())
            data[len(data) // 2] ^= 0xFF
            victim.write_bytes(bytes(data))


def _abort() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # a test's crash leaves no core file behind
    os.abort()


def _sleep_forever() -> None:
    while True:
        time.sleep(3600)

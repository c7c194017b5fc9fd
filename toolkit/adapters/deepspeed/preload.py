"""What every DeepSpeed rank would otherwise load for itself at each start, done once in the launcher's
forkserver (``train.worker.preload_modules``), which outlives restarts: JIT-built CPU ops, lazy imports.

Without a GPU every DeepSpeed rank loads two JIT-built ops: the shared-memory collectives
(``deepspeed.comm`` builds them in ``init_distributed``) and the CPU FusedAdam. Each load runs ninja
over the build folder under a file lock and dlopens the result: the local ranks queue on the lock,
a restarted rank does it all again, and a rank killed while it holds the lock (a fault, the hang
watchdog) leaves the lock behind for the next ranks to wait on forever. Loaded here, in the
forkserver that outlives restarts, the ops sit in DeepSpeed's op cache (``OpBuilder._loaded_ops``)
of every rank forked from it: no rank, first or restarted, runs ninja or takes the lock.

``deepspeed.initialize`` also imports its Muon optimizer module to check the optimizer is one ZeRO
supports; that module calls ``torch.compile`` at import, which imports inductor: 2.5-3 s of a
restarted rank's ~3.4 s engine build on the tiny CPU job (0.9 s once imported here).

Importing this module does the loading (a forkserver preloads modules by name). A failure here is
left for the rank to meet and report: the forkserver must start regardless.
"""
from __future__ import annotations

OPS = ("ShareMemCommBuilder", "FusedAdamBuilder")


def load_ops() -> dict[str, str]:
    """Load ``OPS`` into DeepSpeed's op cache: op -> "loaded", or why not."""
    from toolkit.adapters.deepspeed.engine import _install_op_caches
    _install_op_caches()  # the same build folder and CPU-flag cache the ranks use
    from deepspeed.accelerator import get_accelerator
    outcome = {}
    for name in OPS:
        try:
            builder = get_accelerator().create_op_builder(name)
            if builder is None:
                outcome[name] = "not on this accelerator"
                continue
            builder.load()
            outcome[name] = "loaded"
        except Exception as exc:  # noqa: BLE001 - the rank loads it again and reports the error itself
            outcome[name] = f"{type(exc).__name__}: {exc}"
    return outcome


def import_lazy_modules() -> None:
    """Modules ``deepspeed.initialize`` imports on first use (see above)."""
    try:
        import deepspeed.runtime.zero.muon.muon_optimizer  # noqa: F401
    except Exception:  # noqa: BLE001 - another DeepSpeed version: the rank imports what it needs
        pass


import_lazy_modules()
LOADED = load_ops()

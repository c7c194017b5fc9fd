"""``zero.offload_activations``: what torch's ``save_on_cpu`` (``toolkit.device.host_checkpoint``) puts on
the host, counted at its pack hook, and the bytes the config says it must be (an independent count:
one [micro-batch, seq_len / sp, hidden] input per checkpointed layer)."""
from __future__ import annotations

import contextlib

import torch
from torch.autograd.graph import save_on_cpu


@contextlib.contextmanager
def host_saves():
    """Within: every tensor ``host_checkpoint`` hands to ``save_on_cpu``, as (shape, dtype, bytes), in
    the list yielded. Patches the name ``toolkit.device`` calls (the hook runs as it would)."""
    from toolkit import device
    seen: list[tuple[tuple[int, ...], torch.dtype, int]] = []

    class Counted(save_on_cpu):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            pack = self.pack_hook

            def counted(t):
                seen.append((tuple(t.shape), t.dtype, t.numel() * t.element_size()))
                return pack(t)
            self.pack_hook = counted

    original, device.save_on_cpu = device.save_on_cpu, Counted
    try:
        yield seen
    finally:
        device.save_on_cpu = original


def expected_bytes(cfg, hf_config, micro_batches: int, sp: int = 1) -> int:
    """layers x micro-batches x (micro_batch_size x seq_len / sp x hidden) x the model dtype's bytes."""
    from toolkit.estimate.memory import DTYPE_BYTES
    per_layer = cfg.train.micro_batch_size * cfg.data.seq_len // sp * hf_config.hidden_size
    return hf_config.num_hidden_layers * micro_batches * per_layer * DTYPE_BYTES[cfg.model.dtype]

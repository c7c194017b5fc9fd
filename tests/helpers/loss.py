"""How much memory a loss function allocates, from torch's profiler."""
from __future__ import annotations


def loss_allocations(fn, logits, labels, **kw) -> tuple[int, int]:
    """(peak live bytes, largest single allocation) of torch's CPU allocations during the loss's
    forward and backward, from the profiler's memory events (the logits themselves are allocated
    before; their gradient is among the allocations)."""
    from torch.profiler import ProfilerActivity, profile
    x = logits.detach().clone().requires_grad_(True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss, _ = fn(x, labels, **kw)
        loss.backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak, max(n for _, n in events)

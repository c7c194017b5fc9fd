"""megatron-core version patches that hold on every device (the CPU-only layer is ``megatron_cpu``).

Each names the megatron-core 0.16 behaviour it works around (the pinned release) and touches only
the objects it is given; each is a no-op where that behaviour is absent.
"""
from __future__ import annotations

import torch


def bind_missing_te_names() -> None:
    """megatron-core 0.16's MoE router GEMM tests ``te_general_gemm is not None``, a name
    ``moe_utils`` binds only when Transformer Engine imports: without TE (our images remove it) the
    router raises NameError on CPU and GPU alike. Bound to None, the router takes its torch path."""
    from megatron.core.transformer.moe import moe_utils
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def in_process_write_results() -> None:
    """Our saves are synchronous: megatron's writer runs in this process and reads its own results
    back, so a plain queue does. Megatron's default is a multiprocessing Manager, a server process
    that outlives a rank killed by SIGKILL/SIGTERM and keeps the job's stdout open (the launcher's
    caller then waits forever)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def sub_optimizers(optimizer) -> list:
    """megatron chains a dense and an expert optimizer at ep > 1; one otherwise."""
    return getattr(optimizer, "chained_optimizers", None) or [optimizer]


def materialize_optimizer_state(optimizer) -> None:
    """A fresh torch Adam has no state (no ``step``) for the checkpoint template to describe (a
    load), nor for megatron's ``state_dict`` (a save after fp16 skipped every step so far); one
    step at lr=0 on zero grads creates it without changing a weight, and ``step`` is set back to
    0, so zero moments at step 0 behave exactly as the absent state. A load overwrites it."""
    for opt in sub_optimizers(optimizer):
        inner = opt.optimizer
        if inner.state:
            continue
        saved_lr = [g["lr"] for g in inner.param_groups]
        for g in inner.param_groups:
            g["lr"] = 0.0
            for p in g["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        for g, lr in zip(inner.param_groups, saved_lr):
            g["lr"] = lr
            for p in g["params"]:
                p.grad = None
        for state in inner.state.values():
            state["step"].zero_()


def tolerate_step_state(optimizer) -> None:
    """megatron-core 0.16 with torch's Adam (no Apex/TE): loading the fully reshardable format sets
    ``step`` from the param groups, then copies every state key of each parameter from the
    checkpoint, where ``step`` is not stored per parameter (KeyError). On our instances only, copy
    what the checkpoint has and keep the ``step`` already set."""
    for opt in sub_optimizers(optimizer):
        if opt.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            continue

        def set_states(model_param, tensors, opt=opt):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            main_param = opt.optimizer.param_groups[group_index]["params"][group_order]
            dst = {"param": main_param, **opt.optimizer.state[main_param]}
            missing = set(dst) - set(tensors) - {"step"}
            if missing:
                raise RuntimeError(f"checkpoint lacks optimizer state {sorted(missing)}")
            for key, value in tensors.items():
                dst[key].copy_(value)

        opt._set_main_param_and_optimizer_states = set_states


def unshare_step_tensors(optimizer) -> None:
    """megatron-core 0.16 gives every parameter the *same* ``step`` tensor when it loads a torch
    Adam state; torch increments each parameter's step in place, so a shared one would advance
    once per parameter per step (wrong bias correction). Give each its own copy."""
    for opt in sub_optimizers(optimizer):
        for state in opt.optimizer.state.values():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].clone()


def param_groups_as_mine(optimizer, loaded: dict) -> dict:
    """The loaded optimizer state with the param groups in ``optimizer``'s structure.

    With ep > 1 megatron chains a dense and an expert optimizer; checkpoint tensors are keyed alike
    either way (``chained_optim_avoid_prefix``), but the param groups saved beside them are nested
    per sub-optimizer (``{0: ..., 1: ...}``) or not, as the *saving* run had them. When that differs
    from this run, each sub-optimizer gets its own groups with the saved Adam ``step``: the rest of
    a group (lr, weight decay) the trainer sets every step anyway."""
    subs = sub_optimizers(optimizer)
    nested = len(subs) > 1  # megatron reads a single sub-optimizer's state flat
    mine = [loaded[i] for i in range(len(subs))] if nested else [loaded]
    if any(isinstance(k, int) for k in loaded) == nested and all("optimizer" in d for d in mine):
        return loaded  # saved with this structure
    step = _saved_adam_step(loaded)
    for sub, target in zip(subs, mine):
        groups = sub.state_dict()["optimizer"]["param_groups"]
        target["optimizer"] = {"param_groups": [{**g, "step": step} for g in groups]}
        target["param_state_sharding_type"] = "fully_reshardable"
    for key in [k for k in loaded if isinstance(k, int) != nested]:
        del loaded[key]  # the saving structure's entries: flat groups, or per-optimizer ones
    return loaded


def _saved_adam_step(loaded: dict) -> float:
    """The one Adam step count of every param group in a loaded optimizer state (flat or nested)."""
    holders = [loaded, *(v for v in loaded.values() if isinstance(v, dict))]
    steps = {g.get("step") for d in holders if isinstance(d.get("optimizer"), dict)
             for g in d["optimizer"].get("param_groups", [])}
    if len(steps) != 1:
        raise RuntimeError(f"the checkpoint's optimizer param groups hold Adam steps {sorted(map(str, steps))}, "
                           "expected exactly one; it was not written by megatron-core's distributed optimizer or "
                           "toolkit convert (resume with --resume never, or convert it again)")
    return steps.pop()

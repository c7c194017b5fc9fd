"""How long a rank may stay silent in each heartbeat phase before the watchdog calls it hung.

The rule (``restart.*`` keys, each overridable): steps, ``ready`` and eval batches get
``hang_timeout_s``; reshard, save and export move the model's bytes, so theirs is
``hang_timeout_s + bytes / io_bytes_per_s``, and load's ``startup_s + bytes / io_bytes_per_s``
(a rank's start costs imports, the process group and the tokenizer before any byte moves), with

  load     weights (4 bytes/param) + a checkpoint of the trained parameters (16 bytes/param)
  reshard  that checkpoint read and written again (2 x 16 bytes/param)
  save     a checkpoint of the trained parameters (16 bytes/param: weights, fp32 master, Adam moments)
  export   the whole model in fp32 (4 bytes/param), as hf_final is written

Whole-model bytes, not a rank's share: the budget also holds when a phase beats only at its ends
(DeepSpeed's load, megatron's save) or one rank writes alone while the others wait for it. Work
that beats as it goes (per tensor, file or batch) is judged by its silences, so it may take longer
than its budget in all. The process-group timeout is set above the largest budget
(``collective_timeout_s``): a rank waiting in a collective for a healthy peer never times out
before the watchdog has judged that peer.
"""
from __future__ import annotations

from toolkit.checkpoint.async_save import BYTES_PER_PARAM
from toolkit.config import RestartConfig

WEIGHT_BYTES = 4  # fp32: hf_final's dtype, and the widest weights a load reads
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0  # torch's gloo default is 30 min; ours was 10 min before budgets


def phase_budgets(restart: RestartConfig, trained_params: int, total_params: int) -> dict[str, float]:
    """Seconds of silence allowed per heartbeat phase ({} when the watchdog is off)."""
    if not restart.hang_timeout_s:
        return {}
    ckpt = trained_params * BYTES_PER_PARAM
    moved = {"load": total_params * WEIGHT_BYTES + ckpt, "reshard": 2 * ckpt, "save": ckpt,
             "export": total_params * WEIGHT_BYTES}
    budgets = {phase: restart.hang_timeout_s + nbytes / restart.io_bytes_per_s for phase, nbytes in moved.items()}
    budgets["load"] += restart.startup_s - restart.hang_timeout_s
    budgets.update(step=restart.hang_timeout_s, ready=restart.hang_timeout_s,
                   eval=restart.eval_timeout_s or restart.hang_timeout_s)
    for phase in ("load", "reshard", "save", "export"):
        explicit = getattr(restart, f"{phase}_timeout_s")
        if explicit is not None:
            budgets[phase] = explicit
    return {phase: round(seconds, 3) for phase, seconds in budgets.items()}


def collective_timeout_s(budgets: dict[str, float]) -> float:
    """The process-group timeout: the largest budget plus a step's (the watchdog's margin to poll,
    dump stacks and kill), so that the watchdog, whose stacks name the phase, judges a silent peer
    before a rank waiting for it in a collective gives up; never below the 10 minutes used before."""
    if not budgets:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    return max(DEFAULT_COLLECTIVE_TIMEOUT_S, max(budgets.values()) + budgets["step"])


def load_budget(plan_path) -> float | None:
    """The agent's budget for a rank that has not beaten yet (``toolkit train``'s ranks beat ``load``
    from their start); None when the watchdog is off."""
    from toolkit.plan import read_plan
    plan = read_plan(plan_path)
    return phase_budgets(plan.config.restart, *plan.trainable_parameters()).get("load")

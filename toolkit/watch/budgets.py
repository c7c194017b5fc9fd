"""How long a rank may stay silent in each heartbeat phase before the watchdog calls it hung.

The rule (``restart.*`` keys, each overridable): steps, ``ready`` and eval batches get
``hang_timeout_s``; reshard, save and export move the model's bytes, so theirs is
``hang_timeout_s + bytes / io_bytes_per_s``, and load's ``startup_s + bytes / io_bytes_per_s``
(a rank's start costs imports, the process group and the tokenizer before any byte moves), with

  load     weights (4 bytes/param) + a checkpoint of the trained parameters (16 bytes/param)
  reshard  that checkpoint read and written again (2 x 16 bytes/param)
  save     a checkpoint of the trained parameters (16 bytes/param: weights, fp32 master, Adam moments)
  export   the whole model in fp32 (4 bytes/param), as hf_final is written

A rank's budgets count the bytes that rank moves (``RankShare``): its model-parallel slice of the
weights (one rank of each slice writes them alone: DeepSpeed's model-states file, megatron's
replica 0) and its node's part of the optimizer state (12 of the 16 bytes/param, split over the
ranks that shard it: ZeRO-1+ and megatron's distributed optimizer; a node's local rank 0 persists
the node's files). Reshard and export stay whole-model: rank 0 converts and writes them alone. A
70B save on 512 ranks gets minutes, not the 3 hours the whole checkpoint would take at 100 MB/s.
Safe because a job is hung only when every rank is silent beyond its own budget: a rank waiting
for a slower peer is silent, not stuck, while that peer beats.

Work that beats as it goes (per tensor, file or batch) is judged by its silences, so it may take
longer than its budget in all; the whole-model budgets bound a phase's duration (at
``io_bytes_per_s``), and the process-group timeout is set above the largest of them
(``collective_timeout_s``): a rank waiting in a collective for a healthy peer's lone write never
times out before the watchdog has judged that peer.
"""
from __future__ import annotations

from dataclasses import dataclass

from toolkit.config import RestartConfig
from toolkit.estimate.goodput import CHECKPOINT_BYTES_PER_PARAM

WEIGHT_BYTES = 4  # fp32: hf_final's dtype, and the widest weights a load reads
OPTIMIZER_BYTES = CHECKPOINT_BYTES_PER_PARAM - WEIGHT_BYTES  # fp32 master + two Adam moments
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0  # torch's gloo default is 30 min; ours was 10 min before budgets


@dataclass(frozen=True)
class RankShare:
    """What part of the model's bytes one rank moves: the weights are split over ``mp`` (tp x pp)
    model-parallel slices, the optimizer state over ``optimizer_shards`` ranks (1: ZeRO-0 keeps it
    whole), and a node's ``local`` ranks persist through one of them. The default: the whole model."""

    mp: int = 1
    optimizer_shards: int = 1
    local: int = 1

    def of_checkpoint(self, trained_params: int) -> float:
        """Bytes of a checkpoint this rank (or its node's persister) writes: its slice of the
        weights, alone, and its node's part of the optimizer state."""
        optimizer = OPTIMIZER_BYTES * trained_params * min(1.0, self.local / self.optimizer_shards)
        return WEIGHT_BYTES * trained_params / self.mp + optimizer


def phase_budgets(restart: RestartConfig, trained_params: int, total_params: int,
                  share: RankShare | None = None) -> dict[str, float]:
    """Seconds of silence allowed per heartbeat phase ({} when the watchdog is off); ``share``: the
    rank's (``rank_share``), else whole-model budgets (the agent's, before a rank has beaten)."""
    if not restart.hang_timeout_s:
        return {}
    share = share or RankShare()
    ckpt, whole_ckpt = share.of_checkpoint(trained_params), trained_params * CHECKPOINT_BYTES_PER_PARAM
    moved = {"load": total_params * WEIGHT_BYTES / share.mp + ckpt, "reshard": 2 * whole_ckpt, "save": ckpt,
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


def rank_share(plan, world: int, local: int) -> RankShare:
    """This rank's share in a job of ``world`` ranks, ``local`` of them on its node."""
    lay = plan.layout(world)
    sharded = plan.config.backend == "megatron" or lay.zero_stage >= 1  # megatron: distributed optimizer
    return RankShare(mp=lay.tp * lay.pp, optimizer_shards=world if sharded else 1, local=local)


def collective_timeout_s(budgets: dict[str, float]) -> float:
    """The process-group timeout: the largest budget plus a step's (the watchdog's margin to poll,
    dump stacks and kill), so that the watchdog, whose stacks name the phase, judges a silent peer
    before a rank waiting for it in a collective gives up; never below the 10 minutes used before.
    ``budgets``: the whole-model ones, which bound a lone writer's whole phase."""
    if not budgets:
        return DEFAULT_COLLECTIVE_TIMEOUT_S
    return max(DEFAULT_COLLECTIVE_TIMEOUT_S, max(budgets.values()) + budgets["step"])


def plan_collective_timeout_s(plan) -> float:
    """The timeout of every process group of a job of ``plan`` (the default group, megatron's):
    the same on every rank, from the whole-model budgets."""
    return collective_timeout_s(phase_budgets(plan.config.restart, *plan.trainable_parameters()))


def load_budget(plan_path) -> float | None:
    """The agent's budget for a rank that has not beaten yet (``toolkit train``'s ranks beat ``load``
    from their start); None when the watchdog is off."""
    from toolkit.plan import read_plan
    plan = read_plan(plan_path)
    return phase_budgets(plan.config.restart, *plan.trainable_parameters()).get("load")

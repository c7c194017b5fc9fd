"""Goodput: the share of a job's wall time spent on steps that count, given how often it fails.

A job takes ``step_s`` per step, saves every ``save_every`` steps (each save blocking ``save_s``) and
fails on average once per ``mtbf_s`` seconds (the whole job's: n nodes of node MTBF m fail once per
m / n). Each failure costs its recovery ``recovery_s`` (detection, restart, checkpoint load, first step:
``breakdown_s`` of events.jsonl's ``recovered``; a hang first stays silent ``restart.hang_timeout_s``)
and the work since the last checkpoint, which is computed again. With failures a Poisson process
that can also strike during a recovery, one interval of W = save_every x step_s + save_s seconds
takes on average (Daly, "A higher order estimate of the optimum checkpoint interval", 2006)

    E[T] = M e^(R/M) (e^(W/M) - 1)        M = mtbf_s, R = recovery_s

and goodput = save_every x step_s / E[T]; to first order in W/M and R/M, (1 - s/W)(1 - (R + W/2)/M):
the saves' share, then one recovery and half an interval redone per failure. The save interval that
maximizes it is close to Young's sqrt(2 s M) seconds of work (``best_save_every``). A job's one-time
setup (launch, first load) is left out: it does not grow with the job's length.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

CHECKPOINT_BYTES_PER_PARAM = 16  # bf16/fp32 weights + fp32 master + two Adam moments: what a checkpoint may need


def goodput(mtbf_s: float, step_s: float, save_every: int, save_s: float, recovery_s: float,
            fail_in_recovery: bool = True) -> float:
    """Expected share of wall time on steps that count (0 when failures come faster than an interval
    can finish). ``fail_in_recovery=False``: failures strike only while the job works and saves
    (``mtbf_s`` counts that time only: faults injected at steps, as in the soak), so
    E[T] = (M + R)(e^(W/M) - 1)."""
    for name, value in (("mtbf_s", mtbf_s), ("step_s", step_s), ("save_every", save_every)):
        if value <= 0:
            raise ValueError(f"goodput: {name}={value} must be positive")
    if save_s < 0 or recovery_s < 0:
        raise ValueError(f"goodput: save_s={save_s} and recovery_s={recovery_s} must be >= 0")
    work = save_every * step_s
    exponent = (work + save_s + recovery_s) / mtbf_s
    if exponent > 700:  # e^700 ~ 1e304: no interval ever completes
        return 0.0
    if fail_in_recovery:
        expected = mtbf_s * math.exp(recovery_s / mtbf_s) * math.expm1((work + save_s) / mtbf_s)
    else:
        expected = (mtbf_s + recovery_s) * math.expm1((work + save_s) / mtbf_s)
    return work / expected


def best_save_every(mtbf_s: float, step_s: float, save_s: float) -> int:
    """Young's interval sqrt(2 save_s mtbf_s), in whole steps (at least 1)."""
    return max(1, round(math.sqrt(2 * save_s * mtbf_s) / step_s))


@dataclass
class Goodput:
    """A modelled job: its times and the goodput at its MTBF, with its save interval and the best one."""
    mtbf_s: float
    step_s: float
    save_every: int
    save_s: float
    recovery_s: float
    goodput: float
    best_save_every: int
    best_goodput: float

    def as_dict(self) -> dict:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in asdict(self).items()}


def model(mtbf_s: float, step_s: float, save_every: int, save_s: float, recovery_s: float) -> Goodput:
    best = best_save_every(mtbf_s, step_s, save_s)
    return Goodput(mtbf_s, step_s, save_every, save_s, recovery_s, goodput(mtbf_s, step_s, save_every, save_s, recovery_s),
                   best, goodput(mtbf_s, step_s, best, save_s, recovery_s))


def checkpoint_seconds(trained_params: int, nodes: int, gb_per_s_per_node: float) -> float:
    """Seconds to write (or read) a whole checkpoint when every node moves its share at once."""
    return trained_params * CHECKPOINT_BYTES_PER_PARAM / (nodes * gb_per_s_per_node * 1e9)


def recovery_seconds(load_s: float, step_s: float, *, start_s: float, backoff_s: float = 1.0,
                     detect_s: float = 0.0) -> float:
    """A restart's cost as events.jsonl breaks it down: detection (a crash: the monitor's poll; a hang:
    restart.hang_timeout_s), backoff, ranks restarted and built (``start_s``), checkpoint loaded,
    first step."""
    return detect_s + backoff_s + start_s + load_s + step_s

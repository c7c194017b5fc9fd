"""The goodput model (``toolkit/estimate/goodput.py``) against a simulation of the job it describes:
intervals of work and a save, failures a Poisson process (also during recoveries), each failure
followed by a recovery and the interval again from its start."""
from __future__ import annotations

import math
import random

import pytest

from toolkit.estimate.goodput import best_save_every, checkpoint_seconds, goodput, model, recovery_seconds


def simulated_goodput(mtbf_s, step_s, save_every, save_s, recovery_s, fail_in_recovery=True, intervals=20000,
                     seed=0) -> float:
    rng = random.Random(seed)
    work, wall = save_every * step_s, 0.0
    for _ in range(intervals):
        while True:
            failure = rng.expovariate(1 / mtbf_s)
            if failure >= work + save_s:
                wall += work + save_s
                break
            wall += failure
            while True:  # recover; a failure during the recovery starts it again
                again = rng.expovariate(1 / mtbf_s) if fail_in_recovery else math.inf
                if again >= recovery_s:
                    wall += recovery_s
                    break
                wall += again
    return intervals * work / wall


@pytest.mark.parametrize("case", [
    dict(mtbf_s=600, step_s=2.0, save_every=50, save_s=20, recovery_s=60),    # a failure every 5-6 intervals
    dict(mtbf_s=3600, step_s=5.0, save_every=100, save_s=30, recovery_s=300),  # a hang's detection in R
    dict(mtbf_s=200, step_s=1.0, save_every=100, save_s=10, recovery_s=30),   # an interval ~ the MTBF
])
def test_goodput_equals_a_simulated_job(case):
    assert goodput(**case) == pytest.approx(simulated_goodput(**case), rel=0.02)


@pytest.mark.parametrize("case", [
    dict(mtbf_s=6.0, step_s=0.4, save_every=4, save_s=2.0, recovery_s=15.0),  # the soak's regime: dense faults
    dict(mtbf_s=600, step_s=2.0, save_every=50, save_s=20, recovery_s=60),
])
def test_goodput_when_failures_strike_only_work_equals_a_simulated_job(case):
    """Faults injected at steps (the soak) never strike a recovery: the MTBF counts work time only."""
    assert goodput(**case, fail_in_recovery=False) == pytest.approx(simulated_goodput(**case, fail_in_recovery=False),
                                                                  rel=0.02)


def test_without_failures_only_the_saves_cost():
    assert goodput(1e15, 1.0, 100, 25.0, 60.0) == pytest.approx(100 / 125, rel=1e-9)
    assert goodput(1e15, 1.0, 100, 0.0, 60.0) == pytest.approx(1.0, rel=1e-9)


def test_first_order_form_when_failures_are_rare():
    mtbf, step, every, save, rec = 86400.0, 3.0, 100, 20.0, 120.0
    work = every * step + save
    first_order = (every * step / work) * (1 - (rec + work / 2) / mtbf)
    assert goodput(mtbf, step, every, save, rec) == pytest.approx(first_order, rel=1e-3)


def test_young_interval_is_near_the_best():
    mtbf, step, save, rec = 6 * 3600.0, 4.0, 30.0, 120.0
    best = best_save_every(mtbf, step, save)
    assert best == round(math.sqrt(2 * save * mtbf) / step)
    scan = {k: goodput(mtbf, step, k, save, rec) for k in range(1, 2000)}
    assert goodput(mtbf, step, best, save, rec) >= 0.999 * max(scan.values())
    m = model(mtbf, step, 100, save, rec)
    assert m.best_save_every == best and m.best_goodput >= m.goodput


def test_failures_faster_than_an_interval_give_zero_and_bad_input_is_named():
    assert goodput(1.0, 10.0, 1000, 0.0, 0.0) == 0.0
    with pytest.raises(ValueError, match="mtbf_s=0 must be positive"):
        goodput(0, 1.0, 10, 1.0, 1.0)
    with pytest.raises(ValueError, match="save_s=-1"):
        goodput(10, 1.0, 10, -1, 1.0)


def test_checkpoint_and_recovery_seconds():
    assert checkpoint_seconds(7_000_000_000, nodes=8, gb_per_s_per_node=2.0) == pytest.approx(7e9 * 16 / 16e9)
    assert recovery_seconds(5.0, 2.0, start_s=60.0, backoff_s=1.0, detect_s=300.0) == 368.0

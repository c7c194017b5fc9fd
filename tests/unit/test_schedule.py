"""The LR schedule against its closed form, at steps where the schedules differ (a cosine replaced
by a linear decay, or a warmup off by one, must fail here)."""
import math

import pytest

from toolkit.config import TrainConfig
from toolkit.train.schedule import lr_at

STEPS, WARMUP, PEAK, FLOOR = 100, 10, 1.0, 0.1
DECAY_STEPS = [10, 20, 32, 55, 77, 90, 99, 100]  # progress 0, 0.11, 0.24, 0.5, 0.74, 0.89, 0.99, 1


def _progress(step: int) -> float:
    return min(1.0, (step - WARMUP) / (STEPS - WARMUP))


def cosine(step: int) -> float:
    """Cosine from PEAK at the end of warmup to FLOOR at STEPS (SGDR / Megatron's cosine decay)."""
    return FLOOR + (PEAK - FLOOR) * 0.5 * (1 + math.cos(math.pi * _progress(step)))


def linear(step: int) -> float:
    return PEAK - (PEAK - FLOOR) * _progress(step)


def _config(schedule: str) -> TrainConfig:
    return TrainConfig(steps=STEPS, warmup_steps=WARMUP, lr=PEAK, min_lr=FLOOR, lr_schedule=schedule)


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_linear_warmup_reaches_the_peak_at_the_last_warmup_step(schedule):
    t = _config(schedule)
    assert [lr_at(s, t) for s in range(WARMUP)] == pytest.approx([PEAK * (s + 1) / WARMUP for s in range(WARMUP)],
                                                                 rel=1e-12)


@pytest.mark.parametrize("schedule,closed_form", [("cosine", cosine), ("linear", linear),
                                                  ("constant", lambda step: PEAK)])
def test_decay_follows_the_closed_form(schedule, closed_form):
    t = _config(schedule)
    assert [lr_at(s, t) for s in DECAY_STEPS] == pytest.approx([closed_form(s) for s in DECAY_STEPS], rel=1e-12)


def test_the_sampled_steps_tell_the_schedules_apart():
    """Guard on the test itself: away from both ends cosine and linear differ by far more than the
    tolerance above (0.0935 at step 32), so swapping one for the other cannot pass."""
    inner = [s for s in DECAY_STEPS if 0 < _progress(s) < 1 and _progress(s) != 0.5]
    assert min(abs(cosine(s) - linear(s)) for s in inner) > 1e-3


def test_past_the_last_step_the_lr_stays_at_min_lr():
    assert lr_at(STEPS + 5, _config("cosine")) == pytest.approx(FLOOR, rel=1e-12)
    assert lr_at(STEPS + 5, _config("linear")) == pytest.approx(FLOOR, rel=1e-12)

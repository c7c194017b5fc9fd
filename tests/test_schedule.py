import pytest

from toolkit.config import TrainConfig
from toolkit.train.schedule import lr_at


def test_warmup_then_cosine_to_min_lr():
    t = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(10, t) == pytest.approx(1.0)
    assert lr_at(55, t) == pytest.approx(0.55)
    assert lr_at(100, t) == pytest.approx(0.1)


@pytest.mark.parametrize("schedule,mid", [("linear", 0.55), ("constant", 1.0)])
def test_other_schedules(schedule, mid):
    t = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, lr_schedule=schedule)
    assert lr_at(55, t) == pytest.approx(mid)

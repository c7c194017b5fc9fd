"""The agent's restart backoff doubles inside a crash loop and starts over once the job makes progress."""
from toolkit.launch.agent import MAX_BACKOFF_S, failure_streak, restart_delay


def test_backoff_doubles_while_failures_repeat_at_one_step():
    streak, at = 0, None
    delays = []
    for _ in range(8):
        streak, at = failure_streak(streak, at, reached=12)
        delays.append(restart_delay(1.0, streak))
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, MAX_BACKOFF_S, MAX_BACKOFF_S, MAX_BACKOFF_S]


def test_backoff_starts_over_after_progress():
    """The 50-fault soak's finding: the delay reached its cap at the 7th restart and then dominated
    recovery, although each fault struck a job that had moved on since the previous one."""
    streak, at = 0, None
    for step in (4, 9, 15, 22, 30, 41, 47, 53):
        streak, at = failure_streak(streak, at, reached=step)
        assert restart_delay(0.2, streak) == 0.2


def test_backoff_counts_failures_before_any_step():
    """A rank that dies before its first beat (no step known) is a crash loop, not progress."""
    streak, at = failure_streak(0, None, None)
    streak, at = failure_streak(streak, at, None)
    assert (streak, at) == (2, None) and restart_delay(1.0, streak) == 2.0

"""The detached controller's Slurm warning (toolkit.detach.signal_delay_s): Slurm may send ``--signal`` up to 60 s
earlier than asked (sbatch(1)), and a warning before submitit's handler is up kills the controller instead of
requeueing it, so the asked delay leaves the handler its start-up time whatever the limit."""

import pytest

from toolkit import detach


@pytest.mark.parametrize("limit_min", [detach.MIN_CONTROLLER_TIME_MIN, 3, 5, 30, 24 * 60, 7 * 24 * 60])
def test_the_earliest_warning_comes_after_the_controller_is_up(limit_min):
    delay = detach.signal_delay_s(limit_min)
    earliest = limit_min * 60 - delay - detach.SLURM_SIGNAL_EARLY_S  # seconds after the start
    assert earliest >= detach.HANDLER_START_S
    assert 1 <= delay <= 90


def test_long_limits_are_warned_90_s_ahead_and_short_ones_less():
    assert detach.signal_delay_s(24 * 60) == 90 and detach.signal_delay_s(3) == 90
    # a 2-minute controller: warned 30 s ahead, so no earlier than 30 s after its start
    assert detach.signal_delay_s(2) == 30


def _earliest_warning_s(limit_min: int) -> int:
    return limit_min * 60 - detach.signal_delay_s(limit_min) - detach.SLURM_SIGNAL_EARLY_S


def test_the_shortest_controller_limit_is_the_shortest_that_is_safe():
    """MIN_CONTROLLER_TIME_MIN is where the property starts to hold: one minute less and Slurm's earliest warning
    could come before submitit's handler is up, whatever delay signal_delay_s asks for (a 1-minute limit could be
    warned at the start)."""
    shortest = detach.MIN_CONTROLLER_TIME_MIN
    assert _earliest_warning_s(shortest) >= detach.HANDLER_START_S
    assert _earliest_warning_s(shortest - 1) < detach.HANDLER_START_S

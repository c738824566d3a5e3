"""Throttle: the first call speaks, then nothing until the period has passed."""

import time

from kvfs.ratelimit import Throttle


def test_first_call_is_due_then_quiet_for_the_period():
    throttle = Throttle(60)
    assert throttle.due()
    assert not throttle.due()
    assert not throttle.due()


def test_due_again_after_the_period():
    throttle = Throttle(0.05)
    assert throttle.due()
    time.sleep(0.06)
    assert throttle.due()
    assert not throttle.due()


def test_throttles_are_independent():
    moves, commits = Throttle(60), Throttle(60)
    assert moves.due()
    assert commits.due()  # one failure kind being quiet does not silence another
    assert not moves.due()

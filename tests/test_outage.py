"""Bounded failure under a storage outage: with_retries' time budget (a fake clock), and real
training runs whose GCS server (an emulator each test starts itself) dies or freezes mid-run."""
import pytest

import storage


class FakeTime:
    """storage's clock and sleep: sleeping advances the clock, and each failing call costs
    `attempt_s` (gcsfs's own retries inside one of our attempts)."""

    def __init__(self, attempt_s):
        self.now, self.attempt_s, self.sleeps = 0.0, attempt_s, []

    def sleep(self, seconds):
        self.sleeps.append(seconds)
        self.now += seconds

    def failing_until(self, recovers_at):
        calls = []

        def fn():
            calls.append(self.now)
            self.now += self.attempt_s
            if self.now < recovers_at:
                raise ConnectionError("Cannot connect to host")
            return "ok"
        return fn, calls


@pytest.fixture
def fake_time(monkeypatch):
    def make(attempt_s):
        clock = FakeTime(attempt_s)
        monkeypatch.setattr(storage, "_clock", lambda: clock.now)
        monkeypatch.setattr(storage, "_sleep", clock.sleep)
        return clock
    return make


def test_with_retries_rides_out_a_short_outage_and_gives_up_on_a_lasting_one(fake_time, capsys):
    # Refused connections: each attempt of ours takes ~33 s (gcsfs retries 6 times inside it).
    clock = fake_time(attempt_s=33)
    fn, calls = clock.failing_until(recovers_at=80)  # a 45 s outage that began ~35 s before
    assert storage.with_retries("writing", "gs://b/x", fn) == "ok"
    assert calls == [0, 33.5, 67.5] and clock.sleeps == [0.5, 1.0]

    clock = fake_time(attempt_s=33)
    fn, calls = clock.failing_until(recovers_at=float("inf"))
    with pytest.raises(storage.StorageError, match=r"writing gs://b/x failed after 4 attempts: ConnectionError: "
                                                   r".*cannot be reached.*\(gave up 136s after"):
        storage.with_retries("writing", "gs://b/x", fn)
    assert calls == [0, 33.5, 67.5, 102.5]  # no attempt starts after RETRY_BUDGET_S (120 s)

    # Fast failures: the pause doubles up to RETRY_MAX_DELAY_S; attempts bound them too.
    clock = fake_time(attempt_s=0)
    fn, calls = clock.failing_until(recovers_at=float("inf"))
    with pytest.raises(storage.StorageError, match=r"failed after 10 attempts: .*gave up 76s after"):
        storage.with_retries("reading", "gs://b/y", fn)
    assert clock.sleeps == [0.5, 1, 2, 4, 8, 15, 15, 15, 15]
    # A budget that an attempt overruns: one attempt, no warning; and a best-effort single attempt.
    clock = fake_time(attempt_s=33)
    capsys.readouterr()
    with pytest.raises(storage.StorageError, match=r"failed after 1 attempt: .*gave up 33s after"):
        storage.with_retries("writing", "gs://b/z", clock.failing_until(float("inf"))[0], budget_s=20)
    with pytest.raises(storage.StorageError, match=r"failed after 1 attempt: .*gave up 33s after"):
        storage.with_retries("writing", "gs://b/z", clock.failing_until(float("inf"))[0], attempts=1)
    assert "warning" not in capsys.readouterr().out

"""Fail points: the spec is parsed strictly, and an armed point kills only the chosen rank and step,
on the first attempt of an elastic job."""

import os
import signal
import subprocess
import sys
import time

import pytest

from trainer import failpoints
from trainer.failpoints import ENV, parse

PROBE = "from trainer.failpoints import fail_point; fail_point('train.after_backward', 3); print('survived')"


def test_a_spec_names_a_point_and_optionally_a_rank_and_a_step():
    assert parse("checkpoint.after_engine") == ("checkpoint.after_engine", None, None)
    assert parse("train.after_backward, rank=1, step=3") == ("train.after_backward", 1, 3)


@pytest.mark.parametrize("spec, complaint", [("checkpoint.halfway", "unknown fail point 'checkpoint.halfway'"),
                                              ("train.after_backward,rank=one", "'rank=one' is not rank=<int>"),
                                              ("train.after_backward,when=3", "'when=3' is not rank=<int>")])
def test_a_bad_spec_is_refused_by_name(spec, complaint):
    with pytest.raises(ValueError, match=complaint):
        parse(spec)


def _probe(**env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in (ENV, "RANK", "TORCHELASTIC_RESTART_COUNT")}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=dict(clean, **env),
                          timeout=120)


def test_the_armed_rank_and_step_die_with_sigkill_and_nothing_else_does():
    assert _probe(**{ENV: "train.after_backward,rank=1,step=3", "RANK": "1"}).returncode == -signal.SIGKILL
    for other in ({"RANK": "0"}, {"RANK": "1", "TORCHELASTIC_RESTART_COUNT": "1"}):
        result = _probe(**{ENV: "train.after_backward,rank=1,step=3", **other})
        assert result.returncode == 0 and "survived" in result.stdout, (other, result.stderr)
    assert _probe(**{ENV: "train.after_backward,step=4", "RANK": "1"}).returncode == 0


def test_the_wait_point_holds_the_armed_rank_until_it_is_released(monkeypatch):

    monkeypatch.setattr(failpoints, "_ARMED", ("train.wait_for_sigterm", 0, 2))
    monkeypatch.setenv("RANK", "0")
    asked = []

    def released():
        asked.append(1)
        return len(asked) >= 3  # the third look finds the signal

    failpoints.wait_point("train.wait_for_sigterm", 2, released)
    assert len(asked) == 3
    failpoints.wait_point("train.wait_for_sigterm", 3, lambda: pytest.fail("not armed at step 3: must not wait"))
    started = time.monotonic()
    failpoints.wait_point("train.wait_for_sigterm", 2, lambda: False, limit_s=0.2)  # a signal that never comes
    assert 0.2 <= time.monotonic() - started < 5


def test_with_a_once_marker_the_point_fires_for_the_first_process_only_whatever_its_restart_count(tmp_path):
    """A replacement pod starts at restart count 0 and a node restarted for a membership change does
    not count up: with INSTCLS_FAILPOINT_ONCE the marker on shared storage decides instead."""
    marker = tmp_path / "fired"
    armed = {ENV: "train.after_backward,rank=1,step=3", "RANK": "1", "INSTCLS_FAILPOINT_ONCE": str(marker)}
    assert _probe(**armed, TORCHELASTIC_RESTART_COUNT="2").returncode == -signal.SIGKILL  # fires on any attempt...
    assert marker.exists()
    for count in ("0", "3"):  # ...but only once per job
        result = _probe(**armed, TORCHELASTIC_RESTART_COUNT=count)
        assert result.returncode == 0 and "survived" in result.stdout, result.stderr


def test_the_slow_save_knob_holds_only_its_step_and_refuses_a_bad_value(monkeypatch):
    slept = []
    monkeypatch.setattr(failpoints.time, "sleep", slept.append)
    monkeypatch.setenv(failpoints.SLOW_SAVE_ENV, "40,step=4")
    failpoints.slow_save(3)
    failpoints.slow_save(4)
    assert slept == [40]
    monkeypatch.setenv(failpoints.SLOW_SAVE_ENV, "forty")
    with pytest.raises(ValueError, match="INSTCLS_SLOW_SAVE='forty' is invalid: use SECONDS,step=STEP"):
        failpoints.slow_save(4)

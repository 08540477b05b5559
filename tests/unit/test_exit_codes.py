"""`instcls launch` exits with one code per outcome (``trainer.exit_codes``): 0 finished, 143
preempted (retry, uncounted), 2-4 permanent, 1 a crash; the ranks' own codes get through torchrun,
which says 1 for every failed worker.  The READMEs' tables list exactly these codes.  (The k8s
manifests' rules on them: test_k8s.py.)"""

from __future__ import annotations

import itertools
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from trainer import exit_codes
from trainer.exit_codes import (
    EXIT_CODE_ENV,
    PERMANENT,
    RECREATED,
    RETRYABLE,
    ROUND_ENV,
    ExitCode,
    begin_round,
    node_exit_code,
    reported_exit_codes,
    run_reporting_exit_code,
)
from trainer.parallel import launch as launch_module

ROOT = Path(__file__).resolve().parents[2]
E = ExitCode


@pytest.mark.parametrize("torchrun, ranks, sigterm, expected", [
    (0, [], False, E.FINISHED),
    (1, [E.NONFINITE_LOSS] * 2, False, E.NONFINITE_LOSS),  # torchrun's 1 would read as a crash
    (1, [E.CHECKPOINT_WRITE_FAILED, E.CRASHED], False, E.CHECKPOINT_WRITE_FAILED),  # the other rank lost its peer
    (1, [E.BAD_INPUT, E.NONFINITE_LOSS], False, E.BAD_INPUT),  # the most basic cause first
    (1, [E.BAD_INPUT] * 2, True, E.BAD_INPUT),  # a SIGTERM does not make a bad config retryable
    (1, [E.PREEMPTED] * 2, True, E.PREEMPTED),
    (1, [E.PREEMPTED] * 2, False, E.PREEMPTED),  # another node's pod was preempted: these ranks stopped too
    (1, [], True, E.PREEMPTED),  # killed before they could report (grace period spent): resume the last complete one
    (1, [E.CRASHED, E.PREEMPTED], True, E.PREEMPTED),
    (1, [E.FINISHED] * 2, True, E.FINISHED),  # the run was over when the SIGTERM came
    (1, [E.CRASHED], False, E.CRASHED),
    (1, [], False, E.CRASHED),  # every rank killed (the OOM killer), no SIGTERM
    (-signal.SIGKILL, [], False, 128 + signal.SIGKILL),  # torchrun itself killed: as a shell reports it
    (2, [], False, E.BAD_INPUT),  # torchrun's own usage error
])
def test_the_node_code_comes_from_the_ranks_codes_and_the_signal(torchrun, ranks, sigterm, expected):
    assert node_exit_code(torchrun, ranks, sigterm) == expected


def test_every_code_means_one_thing_to_both_kinds_of_job():
    # Kubeflow's ExitCode policy: 128-255 retried, 1-127 permanent; the Indexed Job names the codes.
    assert all(128 <= code <= 255 for code in RETRYABLE | RECREATED) and all(1 <= code <= 127 for code in PERMANENT)
    assert not RETRYABLE & PERMANENT and not RECREATED & (RETRYABLE | PERMANENT)
    assert set(ExitCode) == RETRYABLE | PERMANENT | RECREATED | {E.FINISHED, E.CRASHED}
    assert E.PREEMPTED == 143 and E.CRASHED == 1  # a shell's SIGTERM code; Python's and torchrun's failure


def _report(tmp_path, monkeypatch, main, rank="3"):
    monkeypatch.setenv(EXIT_CODE_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", rank)
    return run_reporting_exit_code(main)


def test_a_rank_reports_its_code_over_its_own_earlier_report(tmp_path, monkeypatch):
    monkeypatch.delenv(ROUND_ENV, raising=False)  # no agent numbering the rounds
    (tmp_path / "rank-00003").write_text("143")  # an earlier run of this worker
    (tmp_path / "rank-00001").write_text("143")  # another rank's: not this one's to remove
    assert _report(tmp_path, monkeypatch, lambda: E.NONFINITE_LOSS) == E.NONFINITE_LOSS
    assert (tmp_path / "rank-00003").read_text().splitlines()[0] == "3"
    assert reported_exit_codes(tmp_path) == [143, 3]


def _round(tmp_path, monkeypatch) -> None:
    """What the torchrun agent does before it starts a round of workers."""
    monkeypatch.setenv(ROUND_ENV, str(begin_round(tmp_path)))


def test_a_stop_reported_under_another_rank_in_an_earlier_round_does_not_hide_the_last_rounds_crash(
        tmp_path, monkeypatch):
    """The agent re-ranks the nodes at every rendezvous round: this node's rank 5 of round 1 is its
    rank 0 in round 2.  Round 1 was stopped (143, a membership change), round 2 crashed and torchrun
    gave up (1): the node crashed, which the Job counts; 143 would be retried forever, uncounted."""
    monkeypatch.setattr(exit_codes, "_failure_cause", [])
    _round(tmp_path, monkeypatch)
    assert _report(tmp_path, monkeypatch, lambda: E.PREEMPTED, rank="5") == E.PREEMPTED
    _round(tmp_path, monkeypatch)
    with pytest.raises(RuntimeError):
        _report(tmp_path, monkeypatch, _crash, rank="0")
    assert reported_exit_codes(tmp_path) == [E.CRASHED]
    assert node_exit_code(1, reported_exit_codes(tmp_path), got_sigterm=False) == E.CRASHED
    assert sorted(reported_exit_codes(tmp_path, every_round=True)) == [E.CRASHED, E.PREEMPTED]
    assert exit_codes.first_failure(tmp_path) == (0, "RuntimeError: an unhandled error in round 2")


def test_a_last_round_whose_ranks_were_killed_before_reporting_reports_nothing(tmp_path, monkeypatch):
    _round(tmp_path, monkeypatch)
    _report(tmp_path, monkeypatch, lambda: E.PREEMPTED, rank="1")
    _round(tmp_path, monkeypatch)  # its workers were SIGKILLed before their first line
    assert reported_exit_codes(tmp_path) == []
    assert node_exit_code(1, reported_exit_codes(tmp_path), got_sigterm=False) == E.CRASHED


def test_the_hopeless_watch_sees_a_permanent_code_of_a_round_that_has_ended(tmp_path, monkeypatch):
    """torchrun may start the next round before the watch looks: a code no restart heals is final
    whichever round wrote it."""
    from trainer.parallel.hopeless_failure import HopelessFailureWatch

    monkeypatch.setattr(exit_codes, "_failure_cause", [])
    _round(tmp_path, monkeypatch)
    with pytest.raises(RuntimeError):
        _report(tmp_path, monkeypatch, _crash, rank="0")  # failed first, and a restart may heal it
    _round(tmp_path, monkeypatch)
    monkeypatch.setattr(exit_codes, "_failure_cause", [])

    def bad_config():
        exit_codes.record_failure_cause("instcls: error: a bad config")
        return E.BAD_INPUT

    _report(tmp_path, monkeypatch, bad_config, rank="1")
    _round(tmp_path, monkeypatch)

    class Torchrun:
        terminated = False

        def poll(self):
            return None

        def terminate(self):
            self.terminated = True

    lines, torchrun = [], Torchrun()
    with HopelessFailureWatch(tmp_path, torchrun, every_s=0.01, write=lines.append) as watch:
        deadline = time.time() + 10
        while watch.stopped_for is None and time.time() < deadline:
            time.sleep(0.01)
    assert watch.stopped_for == E.BAD_INPUT and torchrun.terminated
    assert lines[0].startswith("instcls launch: rank 1 exited 2 (BAD_INPUT): instcls: error: a bad config. ")


def _crash():
    raise RuntimeError("an unhandled error in round 2")


@pytest.mark.parametrize("failure, code", [(SystemExit(2), E.BAD_INPUT), (SystemExit("bad"), E.CRASHED),
                                           (RuntimeError("a bug"), E.CRASHED)])
def test_a_rank_that_raises_reports_the_code_python_exits_with(tmp_path, monkeypatch, failure, code):
    def main():
        raise failure

    with pytest.raises(type(failure)):
        _report(tmp_path, monkeypatch, main)
    assert reported_exit_codes(tmp_path) == [code]


def test_outside_the_launcher_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(EXIT_CODE_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    assert run_reporting_exit_code(lambda: E.PREEMPTED) == E.PREEMPTED
    assert not list(tmp_path.iterdir())


# Stands in for torchrun: reports this code for rank 0 (none when empty) and exits 1, as torchrun does
# for any failed worker; given a path, it first touches it and waits for a forwarded SIGTERM.
FAKE_TORCHRUN = """
import os, pathlib, signal, sys
code, ready = sys.argv[1], sys.argv[2]
if ready:
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    pathlib.Path(ready).touch()
    signal.sigtimedwait([signal.SIGTERM], 60)
if code:
    (pathlib.Path(os.environ["{env}"]) / "rank-00000").write_text(code)
sys.exit(1)
""".format(env=EXIT_CODE_ENV)


def _launch_fake_torchrun(monkeypatch, code: str, ready: Path | None = None) -> int:
    monkeypatch.setattr(launch_module, "torchrun_command",
                        lambda args: [sys.executable, "-c", FAKE_TORCHRUN, code, str(ready or "")])
    return launch_module.launch([])


def test_launch_exits_with_the_ranks_permanent_code_not_torchruns_1(monkeypatch, capsys):
    assert _launch_fake_torchrun(monkeypatch, "3") == E.NONFINITE_LOSS
    assert "instcls launch: exiting 3 (NONFINITE_LOSS; torchrun exited 1" in capsys.readouterr().err
    assert _launch_fake_torchrun(monkeypatch, "") == E.CRASHED


def test_launch_sent_sigterm_exits_preempted_even_if_the_ranks_could_not_save(monkeypatch, tmp_path, capsys):
    original, ready = signal.getsignal(signal.SIGTERM), tmp_path / "ready"

    def preempt():  # Kubernetes' SIGTERM, once the launcher forwards it and the fake ranks wait for it
        deadline = time.time() + 30
        while time.time() < deadline and (signal.getsignal(signal.SIGTERM) == original or not ready.exists()):
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=preempt)
    sender.start()
    code = _launch_fake_torchrun(monkeypatch, str(int(E.CRASHED)), ready)  # the ranks' save was cut short
    sender.join()
    assert code == E.PREEMPTED
    assert "instcls launch: preempted, exiting 143" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) == original


def exit_code_table(markdown: str) -> dict[int, str]:
    """The rows of the table under the "Exit codes" heading: code -> the rest of the row."""
    lines = re.split(r"^#+ Exit codes", markdown, maxsplit=1, flags=re.M)[1].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = (re.match(r"\| (\d+) \|(.*)", line) for line in itertools.takewhile(lambda line: line.startswith("|"),
                                                                               lines[start:]))
    return {int(m.group(1)): m.group(2) for m in rows if m}


@pytest.mark.parametrize("readme", ["README.md", "k8s/README.md", "docs/cluster.md"])
def test_the_readmes_tables_list_exactly_the_launchers_codes(readme):
    rows = exit_code_table((ROOT / readme).read_text())
    assert sorted(rows) == sorted(int(code) for code in ExitCode), rows
    for code in ExitCode:
        assert f"`{code.name}`" in rows[code], (readme, code)


def test_a_failed_rank_leaves_its_cause_and_the_launcher_names_the_first(tmp_path, monkeypatch):
    from trainer.parallel.launch_notices import failure_cause_line

    monkeypatch.setattr(exit_codes, "_failure_cause", [])

    def bad_shard():
        exit_codes.record_failure_cause("instcls: error: train-000005.tar key 42 at byte 9:\n  truncated")
        return E.BAD_INPUT

    assert _report(tmp_path, monkeypatch, bad_shard, rank="1") == E.BAD_INPUT
    monkeypatch.setattr(exit_codes, "_failure_cause", [])

    def peer():  # fails later, on the connection the first rank's exit closed
        raise RuntimeError("[gloo] Connection closed by peer\n<traceback>")

    with pytest.raises(RuntimeError):
        _report(tmp_path, monkeypatch, peer, rank="0")
    assert exit_codes.first_failure(tmp_path) == (1, "instcls: error: train-000005.tar key 42 at byte 9: truncated")
    assert (tmp_path / "rank-00000").read_text().splitlines()[2] == "RuntimeError: [gloo] Connection closed by peer"
    assert failure_cause_line(tmp_path) == ("instcls launch: the first rank to fail on this node was rank 1: "
                                            "instcls: error: train-000005.tar key 42 at byte 9: truncated")
    finished = tmp_path / "finished"
    finished.mkdir()
    monkeypatch.setattr(exit_codes, "_failure_cause", ["a line from an earlier, handled problem"])
    _report(finished, monkeypatch, lambda: E.PREEMPTED, rank="0")
    assert failure_cause_line(finished) is None and (finished / "started-00000").exists()


def test_a_node_waiting_for_the_rendezvous_says_so_until_a_rank_starts(tmp_path):
    from trainer.parallel.launch_notices import RendezvousNotice, rendezvous_description

    description = rendezvous_description(["--nnodes", "2", "--nproc-per-node", "2", "-m", "trainer.cli", "train"])
    assert description.startswith("2 node(s) (--nnodes 2) at 127.0.0.1:29500 (static); this node (")
    assert "join_timeout=600 s" in description
    lines, described = [], []
    # the description is made once, for the first line (torchrun's parser imports torch)
    with RendezvousNotice(tmp_path, lambda: described.append(1) or description, every_s=0.02, write=lines.append):
        deadline = time.time() + 10
        while len(lines) < 2 and time.time() < deadline:
            time.sleep(0.01)
        (tmp_path / "started-00000").touch()  # torchrun started this node's workers: the rendezvous is over
        time.sleep(0.1)
        said = len(lines)
        time.sleep(0.1)
    assert said >= 2 and len(lines) == said, "no line after a rank started"
    assert described == [1]
    assert lines[0].startswith("instcls launch: waited 0 s for the rendezvous of 2 node(s)")


@pytest.mark.parametrize(("code", "started", "tail", "expected"), [
    (E.CRASHED, True, "RendezvousConnectionError: The connection to the C10d store has failed", E.STORE_HOST_LOST),
    (E.CRASHED, False, "RendezvousConnectionError: ...", E.CRASHED),  # never ran: a wrong endpoint, not a lost host
    (E.CRASHED, True, "RuntimeError: CUDA out of memory", E.CRASHED),
    (E.BAD_INPUT, True, "RendezvousConnectionError", E.BAD_INPUT),  # a permanent code stays
    (E.PREEMPTED, True, "RendezvousConnectionError", E.PREEMPTED),
])
def test_a_lost_store_host_is_retried_where_a_crash_would_fail_the_job(code, started, tail, expected):
    """The pod hosting the c10d store gone mid-run ends every other agent with torch's
    RendezvousConnectionError: a code the ExitCode policy recreates (1 would fail the whole job)."""
    from trainer.exit_codes import with_lost_store_host

    assert with_lost_store_host(code, started, tail) == expected

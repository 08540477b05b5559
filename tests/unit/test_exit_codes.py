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

from trainer.exit_codes import (
    EXIT_CODE_ENV,
    PERMANENT,
    RETRYABLE,
    ExitCode,
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
    assert all(128 <= code <= 255 for code in RETRYABLE) and all(1 <= code <= 127 for code in PERMANENT)
    assert not RETRYABLE & PERMANENT
    assert set(ExitCode) == RETRYABLE | PERMANENT | {E.FINISHED, E.CRASHED}
    assert E.PREEMPTED == 143 and E.CRASHED == 1  # a shell's SIGTERM code; Python's and torchrun's failure


def _report(tmp_path, monkeypatch, main, rank="3"):
    monkeypatch.setenv(EXIT_CODE_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", rank)
    return run_reporting_exit_code(main)


def test_a_rank_reports_its_code_and_forgets_the_last_rounds(tmp_path, monkeypatch):
    (tmp_path / "rank-00003").write_text("143")  # torchrun's previous round of workers
    (tmp_path / "rank-00001").write_text("143")  # another rank's: not this one's to remove
    assert _report(tmp_path, monkeypatch, lambda: E.NONFINITE_LOSS) == E.NONFINITE_LOSS
    assert (tmp_path / "rank-00003").read_text().splitlines()[0] == "3"
    assert reported_exit_codes(tmp_path) == [143, 3]


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
    from trainer import exit_codes
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
    lines = []
    with RendezvousNotice(tmp_path, description, every_s=0.02, write=lines.append):
        deadline = time.time() + 10
        while len(lines) < 2 and time.time() < deadline:
            time.sleep(0.01)
        (tmp_path / "started-00000").touch()  # torchrun started this node's workers: the rendezvous is over
        time.sleep(0.1)
        said = len(lines)
        time.sleep(0.1)
    assert said >= 2 and len(lines) == said, "no line after a rank started"
    assert lines[0].startswith("instcls launch: waited 0 s for the rendezvous of 2 node(s)")

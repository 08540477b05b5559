"""Named places where the fault drills kill a process with SIGKILL, as a node loss would.

A drill sets ``INSTCLS_FAILPOINT=NAME[,rank=R][,step=S]`` on a real job; the rank (any rank when
unset) that reaches ``fail_point(NAME, step)`` at that step (any step when unset) kills itself
there, without cleanup, once per job, so that the restarted job runs past the point and shows
whether the run recovers.  "Once" is kept in one of two ways:

* ``INSTCLS_FAILPOINT_ONCE=PATH`` (the multi-node drills): the rank that fires creates PATH, a file
  on storage every node sees, and no attempt that finds it fires again: not a node whose agent
  restarted its workers because another node left (torchrun does not count that as a restart),
  and not a replacement pod, whose restart count starts at 0 again;
* without it, the first attempt of one agent: torchrun's restarts count up
  ``TORCHELASTIC_RESTART_COUNT`` on a single node.

Unset (every real job), a fail point is one comparison.

Points: ``train.after_backward`` (gradients exist, nothing stepped), and in a checkpoint save
``checkpoint.before_engine`` (in the snapshot, on the training thread, before any file), then in
the background writer ``checkpoint.after_engine`` (DeepSpeed files written, the rest not),
``checkpoint.after_components``, ``checkpoint.before_rename`` (manifest written, still ``.tmp``),
``checkpoint.after_rename`` (complete, older ones not yet pruned).  A kill from the writer thread
kills the whole rank, as a node loss would, while training may be running on.

One point corrupts instead of killing: ``train.nan_features`` (``armed``) makes the rank's
features of that step NaN, as a bad batch or an overflow in the backbone would; ``train.inf_gradient``
keeps the features and the loss finite and makes their gradient infinite, as an overflow in the
backward would.  One waits:
``train.wait_for_sigterm`` (``wait_point``, after the backward) holds the rank until it has had
SIGTERM, so that a drill's SIGTERM lands mid-run however fast or slow the machine's steps are.  One
raises: ``eval.end_of_run`` (``armed``) makes the end-of-run evaluation of the rank (of every rank
when unset) fail with an exception partway: after the features are gathered for the linear probe
(the kNN's all-gathers done, and for the "sklearn" probe the gather into rank 0), before the fit;
with no probe, after the kNN (``trainer.evaluation.phase_agreement``).

Beside the points, one knob slows a save down: ``INSTCLS_SLOW_SAVE=SECONDS,step=S`` makes rank 0
hold the checkpoint of step S that long before its rename (``slow_save``), as writing ImageNet-21K's
rows to a shared volume takes, so that a drill can show a membership change letting it finish.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable

ENV = "INSTCLS_FAILPOINT"
SLOW_SAVE_ENV = "INSTCLS_SLOW_SAVE"
ONCE_ENV = "INSTCLS_FAILPOINT_ONCE"
POINTS = (
    "train.after_backward",
    "checkpoint.before_engine",
    "checkpoint.after_engine",
    "checkpoint.after_components",
    "checkpoint.before_rename",
    "checkpoint.after_rename",
    "train.nan_features",
    "train.inf_gradient",
    "train.wait_for_sigterm",
    "eval.end_of_run",
)


def parse(spec: str) -> tuple[str, int | None, int | None]:
    """``NAME[,rank=R][,step=S]`` -> (name, rank, step); a clear error for anything else."""
    name, *options = [part.strip() for part in spec.split(",")]
    if name not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: unknown fail point {name!r}; choose one of {POINTS}")
    found: dict[str, int] = {}
    for option in options:
        key, _, value = option.partition("=")
        if key not in ("rank", "step") or not value.isdigit():
            raise ValueError(f"{ENV}={spec!r}: {option!r} is not rank=<int> or step=<int>")
        found[key] = int(value)
    return name, found.get("rank"), found.get("step")


def _armed() -> tuple[str, int | None, int | None] | None:
    spec = os.environ.get(ENV)
    if not spec or (not os.environ.get(ONCE_ENV) and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"):
        return None
    return parse(spec)


_ARMED = _armed()
_CLAIMED: list[tuple[str, int | None]] = []  # (point, step) this process fired under INSTCLS_FAILPOINT_ONCE


def _claim_once(name: str, step: int | None) -> bool:
    """Under ``INSTCLS_FAILPOINT_ONCE``: True for the one process that creates the marker first (and
    again for the same point and step in that process); without it, always True."""
    marker = os.environ.get(ONCE_ENV)
    if not marker or (name, step) in _CLAIMED:
        return True
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # atomic on a shared filesystem too
    except FileExistsError:
        return False
    _CLAIMED.append((name, step))
    return True


def armed(name: str, step: int | None = None) -> bool:
    """True where the drill armed ``name`` for this rank and step (a corrupting point then acts;
    ``fail_point`` kills)."""
    if _ARMED is None or _ARMED[0] != name:
        return False
    _, rank, at_step = _ARMED
    if rank is not None and rank != int(os.environ.get("RANK", "0")):
        return False
    return (at_step is None or at_step == step) and _claim_once(name, step)


def fail_point(name: str, step: int | None = None) -> None:
    """SIGKILL this process here if the drill armed ``name`` for this rank and step."""
    if not armed(name, step):
        return
    # the time lets a drill measure recovery from the moment of the fault
    print(f"instcls: fail point {name} (step {step}): killing rank {os.environ.get('RANK', '0')} with SIGKILL "
          f"at {time.time():.3f}", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def wait_point(name: str, step: int, released: Callable[[], bool], limit_s: float = 300.0) -> None:
    """Hold this rank here, if the drill armed ``name`` for it and this step, until ``released()``
    (at most ``limit_s``: a drill that never sends its signal still ends)."""
    if not armed(name, step):
        return
    print(f"instcls: fail point {name} (step {step}): rank {os.environ.get('RANK', '0')} (pid {os.getpid()}) waits",
          flush=True)
    deadline = time.monotonic() + limit_s
    while not released() and time.monotonic() < deadline:
        time.sleep(0.05)


def slow_save(step: int) -> None:
    """Sleep here (a checkpoint's commit) when ``INSTCLS_SLOW_SAVE=SECONDS,step=S`` names this step."""
    spec = os.environ.get(SLOW_SAVE_ENV)
    if not spec:
        return
    seconds, _, at = spec.partition(",step=")
    if not (seconds.isdigit() and at.isdigit()):
        raise ValueError(f"{SLOW_SAVE_ENV}={spec!r} is invalid: use SECONDS,step=STEP (whole numbers)")
    if int(at) == step:
        print(f"instcls: {SLOW_SAVE_ENV}: the checkpoint of step {step} takes {seconds} s more", flush=True)
        time.sleep(int(seconds))

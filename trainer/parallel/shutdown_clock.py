"""How long a stopping rank has left before it is SIGKILLed.

torchrun's agent stops its workers with SIGTERM (a Kubernetes preemption it forwards, or a
membership change) and SIGKILLs them ``--shutdown-timeout`` seconds later; ``instcls launch`` sets
that to the pod's grace period minus its margin (``trainer.parallel.launch``), and the agent
(``trainer.parallel.torchrun_agent``) hands its value to the workers in ``SHUTDOWN_TIMEOUT_ENV``.
The rank's SIGTERM handler (``trainer.engine.stop_conditions``) starts the clock; what may wait
during a stop (a checkpoint write's retries, ``trainer.checkpoint.write_retry``) asks
``seconds_left``.
"""

from __future__ import annotations

import os
import time

SHUTDOWN_TIMEOUT_ENV = "INSTCLS_SHUTDOWN_TIMEOUT_S"
DEFAULT_SHUTDOWN_TIMEOUT_S = 30.0  # torchrun's own, when nothing says otherwise

_stop_began: list[float] = []  # time.monotonic() of this rank's first SIGTERM


def shutdown_timeout_s(environ=os.environ) -> float:
    """Seconds from the stop's SIGTERM to the SIGKILL, as the agent told this worker."""
    value = environ.get(SHUTDOWN_TIMEOUT_ENV, "")
    try:
        return float(value) if value else DEFAULT_SHUTDOWN_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{SHUTDOWN_TIMEOUT_ENV}={value!r} is invalid: it is set by instcls launch's torchrun "
                         "agent to its --shutdown-timeout in seconds; unset it or give a number") from None


def begin_shutdown(now: float | None = None) -> None:
    """This rank was told to stop (its SIGTERM handler calls this; later calls change nothing)."""
    if not _stop_began:
        _stop_began.append(time.monotonic() if now is None else now)


def seconds_left(now: float | None = None) -> float | None:
    """Seconds until the SIGKILL of a stop that began; None when no stop began."""
    if not _stop_began:
        return None
    return _stop_began[0] + shutdown_timeout_s() - (time.monotonic() if now is None else now)

"""torchrun, with its agent's stop of its own workers given the job's shutdown timeout:
``python -m trainer.parallel.torchrun_agent ARGS...`` is ``python -m torch.distributed.run ARGS...``
otherwise (what ``instcls launch`` runs).

On a membership change (a node lost, or back) torch's ``LocalElasticAgent`` stops its workers with
``_stop_workers``, which calls ``_shutdown()`` with its default timeout: SIGTERM, then SIGKILL 30 s
later, whatever ``--shutdown-timeout`` says (that flag applies only when the agent itself is
signalled; torch 2.14, ``torch/distributed/elastic/agent/server/local_elastic_agent.py``).  In those
30 s the ranks must agree, wait for the save in flight and write a blocking checkpoint; at
ImageNet-21K's size that does not fit, the save is cut and its steps are trained again.  Here the
agent's own stops take ``--shutdown-timeout`` too, so a node's return lets the save it triggers
finish.

Before each round of workers it starts, the agent also numbers the round in the exit-code directory
(``trainer.exit_codes.begin_round``; the launcher judges the newest round's reports only) and tells
the workers, with the round, how long a stop gives them before SIGKILL
(``trainer.parallel.shutdown_clock``: a save under SIGTERM keeps its retries within it).
"""

from __future__ import annotations

import os
from pathlib import Path

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

from trainer.exit_codes import EXIT_CODE_ENV, ROUND_ENV, begin_round
from trainer.parallel.shutdown_clock import SHUTDOWN_TIMEOUT_ENV

_start_workers = LocalElasticAgent._start_workers


def _stop_workers_patiently(self, worker_group) -> None:
    """``LocalElasticAgent._stop_workers`` with ``--shutdown-timeout`` (``self._shutdown_timeout``)."""
    self._shutdown(timeout=self._shutdown_timeout)


def _start_numbered_round(self, worker_group):
    """``LocalElasticAgent._start_workers``, the round numbered first; the workers inherit this
    process's environment."""
    if os.environ.get(EXIT_CODE_ENV):
        os.environ[ROUND_ENV] = str(begin_round(Path(os.environ[EXIT_CODE_ENV])))
    os.environ[SHUTDOWN_TIMEOUT_ENV] = str(self._shutdown_timeout)
    return _start_workers(self, worker_group)


def patch_agent() -> None:
    """Make every ``LocalElasticAgent`` of this process stop its workers with its shutdown timeout
    and number the rounds it starts."""
    LocalElasticAgent._stop_workers = _stop_workers_patiently
    LocalElasticAgent._start_workers = _start_numbered_round


def main() -> None:
    patch_agent()
    from torch.distributed.run import main as torchrun_main

    torchrun_main()


if __name__ == "__main__":
    main()

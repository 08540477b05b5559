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
"""

from __future__ import annotations

from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent


def _stop_workers_patiently(self, worker_group) -> None:
    """``LocalElasticAgent._stop_workers`` with ``--shutdown-timeout`` (``self._shutdown_timeout``)."""
    self._shutdown(timeout=self._shutdown_timeout)


def patch_agent() -> None:
    """Make every ``LocalElasticAgent`` of this process stop its workers with its shutdown timeout."""
    LocalElasticAgent._stop_workers = _stop_workers_patiently


def main() -> None:
    patch_agent()
    from torch.distributed.run import main as torchrun_main

    torchrun_main()


if __name__ == "__main__":
    main()

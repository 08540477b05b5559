"""Which pod hosts the c10d rendezvous store, named rather than guessed.

Without ``is_host`` in ``--rdzv-conf``, torch's c10d rendezvous decides at agent start whether this
node hosts the store by resolving the endpoint's name and comparing it with its own addresses
(``torch/distributed/elastic/rendezvous/c10d_rendezvous_backend.py``).  Behind a headless service
the record of pod 0 may not be published yet when its agent starts: pod 0 then becomes a client of
a store nobody hosts, and the job waits out its join timeout.  ``instcls launch`` knows the pod's
index (the Indexed Job passes ``--node-rank=$(JOB_COMPLETION_INDEX)``), so it says it: ``is_host=1``
on index 0, ``is_host=0`` elsewhere.  torchrun keeps only the last ``--rdzv-conf`` given, so the
flag is merged into that one (the overlays' ``join_timeout`` and ``last_call_timeout`` stay).
"""

from __future__ import annotations

from trainer.parallel.torchrun_arguments import option_value, options_end

CONF_FLAGS = ("--rdzv-conf", "--rdzv_conf")


def with_rendezvous_host(torchrun_args: list[str]) -> list[str]:
    """``torchrun_args`` with ``is_host`` set in one ``--rdzv-conf`` where the rendezvous is c10d and
    ``--node-rank`` gives the pod's index; unchanged otherwise, or where the conf already says."""
    end = options_end(torchrun_args)
    options, rest = list(torchrun_args[:end]), list(torchrun_args[end:])
    backend = option_value(options, "--rdzv-backend", "--rdzv_backend")
    node_rank = option_value(options, "--node-rank", "--node_rank")
    if backend != "c10d" or node_rank is None or not node_rank.isdigit():
        return list(torchrun_args)
    conf = option_value(options, *CONF_FLAGS) or ""
    entries = [entry for entry in conf.split(",") if entry.strip()]
    if any(entry.split("=", 1)[0].strip() == "is_host" for entry in entries):
        return list(torchrun_args)
    kept, skip = [], False
    for argument in options:  # every --rdzv-conf goes: one merged conf replaces them
        if skip:
            skip = False
            continue
        flag, equals, _ = argument.partition("=")
        if flag in CONF_FLAGS:
            skip = not equals
            continue
        kept.append(argument)
    merged = ",".join([*entries, f"is_host={int(int(node_rank) == 0)}"])
    return [*kept, f"--rdzv-conf={merged}", *rest]

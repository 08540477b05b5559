"""The fault drills' names, in the order `instcls drill` runs them, without importing the drills
(they load torch): the command line offers them when it builds its parser.  ``catalogue.DRILLS``
maps each name to its drill; tests/unit/test_cli_imports.py holds the two equal."""

# The drills on local ranks and agents (``crashes``, ``preemption``, ``nonfinite``, ``ports``,
# ``tampered_files``, ``node_faults``).
LOCAL_DRILLS = (
    "rank-killed-mid-step", "rank-killed-while-saving", "damaged-newest-checkpoint", "disk-full-during-save",
    "preempted-with-sigterm", "peer-preempted", "loss-becomes-nan", "nan-step-skipped", "metrics-port-taken",
    "rendezvous-port-taken", "checkpoint-with-pickled-code", "shard-damaged-mid-run", "shard-damaged-skipped",
    "node-never-arrives",
)
# The k8s overlays with several nodes, whose own pods ``overlay_drills`` breaks, and the elastic ones.
MULTI_NODE_OVERLAYS = ("indexed-job", "indexed-job-elastic", "pytorchjob", "pytorchjob-elastic", "trainjob")
ELASTIC_OVERLAYS = ("indexed-job-elastic", "pytorchjob-elastic")
# ``overlay_drills.OVERLAY_DRILLS`` (every multi-node overlay) and ``ELASTIC_DRILLS`` (elastic ones only).
POD_DRILLS = ("replaced-pod", "store-host-replaced", "preemption", "pod-deleted")
ELASTIC_POD_DRILLS = ("node-lost-for-good", "node-returns")


def overlay_drill_names() -> tuple[str, ...]:
    """``OVERLAY/DRILL`` for every drill of every multi-node overlay."""
    return tuple(f"{overlay}/{drill}" for overlay in MULTI_NODE_OVERLAYS
                 for drill in POD_DRILLS + (ELASTIC_POD_DRILLS if overlay in ELASTIC_OVERLAYS else ()))


def drill_names() -> tuple[str, ...]:
    return LOCAL_DRILLS + overlay_drill_names()

"""Recording a run's provenance when it starts: every rank's host name, then rank 0 writes
``logging.dir/run.json`` and keeps the record for the checkpoints (``ProvenanceState``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from trainer.provenance.checkpoint_entry import ProvenanceState
from trainer.provenance.run_provenance import (
    collect_provenance,
    host_name,
    init_from_record,
    read_provenance,
    write_provenance,
)


@dataclass(frozen=True)
class ConfigOrigin:
    """Where a run's config came from: its file and the ``--set`` overrides as given (None: the
    config was built in Python, ``trainer.train(JobConfig)``; run.json still holds it resolved)."""

    file: Path | None = None
    overrides: tuple[str, ...] = ()


def record_run_start(config, dims, run: str, origin: ConfigOrigin | None, resumed: Path | None) -> ProvenanceState:
    """Collective (one small gather of host names): the run's ``run.json`` written by rank 0, as the
    checkpoint entry that copies it into every checkpoint.  A resumed run records the starting
    weights of the run it continues (its checkpoint's run.json), not ``model.init_from``, which it
    does not load."""
    hosts = [host_name()]
    if dims.is_distributed:
        hosts = [None] * dims.world_size
        dist.all_gather_object(hosts, host_name(), group=dims.control_group)
    if dims.rank != 0:
        return ProvenanceState(None)
    if resumed is None:
        try:
            init_from = init_from_record(config.model.init_from)
        except OSError as error:  # every rank refuses the file when it loads it, naming the fix
            init_from = {"path": str(config.model.init_from), "digest": None, "error": str(error)}
    else:
        try:
            init_from = (read_provenance(resumed) or {}).get("init_from")
        except ValueError:  # a damaged record of the past run must not stop the resume
            init_from = None
    origin = origin or ConfigOrigin()
    provenance = collect_provenance(config, origin.file, list(origin.overrides), dims.world_size, hosts, run,
                                    init_from=init_from, resumed_from=resumed)
    write_provenance(config.logging.dir, provenance)
    return ProvenanceState(provenance)

"""What made a run: its ``run.json`` (config, overrides, code, libraries, hosts, data, starting
weights) and the digests that identify its inputs."""

from trainer.provenance.digests import file_sha256, manifest_digest
from trainer.provenance.run_provenance import (
    RUN_FILE,
    collect_provenance,
    config_yaml,
    describe_provenance,
    read_provenance,
    write_provenance,
)

__all__ = ["RUN_FILE", "collect_provenance", "config_yaml", "describe_provenance", "file_sha256", "manifest_digest",
           "read_provenance", "write_provenance"]

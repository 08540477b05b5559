"""Where images come from when shards are made: one module per kind of source, each declaring its
``SourceKind`` (its name, the flags it reads, how it opens), registered here in ``--source``'s order.

A new source is one module in this folder with its ``SourceKind`` and one line below, plus its
tests; `instcls make-shards` then offers it with its flags (``registry.add_source_arguments``).
"""

from data_pipeline.ingest.sources import files, generated, tars
from data_pipeline.ingest.sources.registry import (
    SOURCES,
    Flag,
    SourceKind,
    add_source_arguments,
    check_labels,
    register_source,
    source_kind,
    unregister_source,
)

for _kind in (files.FOLDER, files.LIST, tars.TARS, generated.DIGITS, generated.DIGIT_SCENES, generated.SYNTHETIC):
    register_source(_kind)

__all__ = ["SOURCES", "Flag", "SourceKind", "add_source_arguments", "check_labels", "register_source", "source_kind",
           "unregister_source"]

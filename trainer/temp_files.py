"""Names for the temporary file an atomic write renames into place.

A name built from the pid alone is not unique: two threads of one process (a merge Job waiting
beside the ingest that merges too) or two containers (both pid 1) writing into one shared
directory would write the same temporary file, and one would rename away the other's.  A random
token beside the pid makes each writer's file its own; the pid stays so an operator can tell whose
leftover a file was, and the ``.tmp-`` marker stays so cleanups still find them.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def temp_sibling(path: Path) -> Path:
    """A fresh name beside ``path`` (same directory, so ``os.replace`` onto it is atomic)."""
    path = Path(path)
    return path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")

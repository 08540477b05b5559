"""Forked loader workers leave the objects they inherit to the parent's garbage collector.

A forked child holds a copy of every object of its parent, unreachable ones included.  When the
child's collector frees such a copy it runs the object's finaliser in a process where the object's
threads do not exist: a DALI ``Pipeline`` left in a reference cycle by an earlier loader in the same
process (``instcls bench data`` runs both loaders in one; so does a test session) then waits forever
in ``Pipeline._shutdown`` for its executor, and the torch loader's worker hangs mid-epoch.

``gc.freeze()`` right before the fork moves every tracked object to the permanent generation, which
no collection visits; the child inherits that, so it never finalises what it inherited, and the
parent unfreezes at once and collects its own garbage as before (the pattern Python's ``gc.freeze``
documentation gives for fork without exec, which also keeps the inherited pages shared).
"""

from __future__ import annotations

import gc
from contextlib import contextmanager
from typing import Iterator


@contextmanager
def children_leave_inherited_objects_alone() -> Iterator[None]:
    """Fork loader workers inside this block."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()

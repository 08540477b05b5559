"""Loss terms the sharded kernel computes in its chunk loop beside the cross-entropy, registered by
name.  A term is a ``ChunkTerm`` (``chunk_term.py``: the protocol and what the kernel tells it);
a registered factory decides, from the classifier's settings and the job's views, whether its term
runs (``None``: not in this job).  The kernel fuses one term per pass.

A new term is one module in this folder (its ``ChunkTerm``, a settings field or two on
``HeadSettings`` if it needs them) and one ``register_term`` line below, plus a test against a
full-matrix reference.  CO2's consistency term (``co2.py``) is the first.
"""

from __future__ import annotations

from typing import Any, Callable

from trainer.classifier.terms.chunk_term import ChunkTerm
from trainer.classifier.terms.co2 import ConsistencyTerm

# (classifier settings: a HeadSettings, the job's ViewLayout) -> the term, or None when it is off
TermFactory = Callable[[Any, Any], "ChunkTerm | None"]
TERMS: dict[str, TermFactory] = {}


def register_term(name: str, factory: TermFactory) -> None:
    if name in TERMS and TERMS[name] is not factory:
        raise ValueError(f"a kernel term named {name!r} is already registered")
    TERMS[name] = factory


def unregister_term(name: str) -> None:
    TERMS.pop(name, None)


def active_term(settings, views) -> ChunkTerm | None:
    """The one term the settings turn on for these views (None: the plain loss)."""
    active = {name: term for name, factory in TERMS.items() if (term := factory(settings, views)) is not None}
    if len(active) > 1:
        raise ValueError(f"the settings turn on the kernel terms {sorted(active)}; the kernel fuses one term per "
                         "pass: turn all but one off")
    return next(iter(active.values()), None)


def _co2(settings, views) -> ConsistencyTerm | None:
    if settings.co2_alpha == 0:
        return None
    return ConsistencyTerm.for_views(settings.co2_temperature, settings.co2_alpha, views.kinds)


register_term("co2", _co2)

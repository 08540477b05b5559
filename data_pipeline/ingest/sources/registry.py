"""The source registry: what `instcls make-shards --source NAME` can read, and the flags each
source adds to the command.

A source is either *images to encode* (``open(args) -> Source``: the shard writer decodes, checks,
shuffles and writes them) or *tars indexed in place* (``index_in_place(args, part)``: nothing
re-encoded).  Flags that several sources share (``--root``, ``--image-size``) are declared by each
with the same argparse options and appear once, their help naming every source that reads them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class Flag:
    """One command-line flag a source reads: ``options`` are ``add_argument``'s keywords but help."""

    name: str
    help: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class SourceKind:
    """name: ``--source`` value; summary: its line in ``--source``'s help; labels: the ``--labels``
    values it understands ("none" first: unlabelled); exactly one of ``open`` / ``index_in_place``."""

    name: str
    summary: str
    flags: tuple[Flag, ...] = ()
    labels: tuple[str, ...] = ("none",)
    open: Callable[[argparse.Namespace], Any] | None = None
    index_in_place: Callable[[argparse.Namespace, Any], Any] | None = None

    def __post_init__(self) -> None:
        if (self.open is None) == (self.index_in_place is None):
            raise ValueError(f"source {self.name!r}: give exactly one of open (images to encode) or index_in_place")
        if not self.labels or self.labels[0] != "none":
            raise ValueError(f"source {self.name!r}: labels must start with 'none' (unlabelled)")


SOURCES: dict[str, SourceKind] = {}


def register_source(kind: SourceKind) -> None:
    if kind.name in SOURCES and SOURCES[kind.name] != kind:
        raise ValueError(f"a source named {kind.name!r} is already registered")
    for flag in kind.flags:  # a shared flag must parse the same way for every source
        for other in SOURCES.values():
            for theirs in other.flags:
                if theirs.name == flag.name and theirs.options != flag.options:
                    raise ValueError(f"source {kind.name!r} declares {flag.name} with {flag.options}, source "
                                     f"{other.name!r} with {theirs.options}: a shared flag needs the same options")
    SOURCES[kind.name] = kind


def unregister_source(name: str) -> None:
    SOURCES.pop(name, None)


def source_kind(name: str) -> SourceKind:
    if name not in SOURCES:
        raise ValueError(f"--source {name} is not a registered source: choose one of {', '.join(SOURCES)}")
    return SOURCES[name]


def add_source_arguments(parser: argparse.ArgumentParser) -> None:
    """``--source``, ``--labels`` and every registered source's flags, each flag once."""
    parser.add_argument("--source", required=True, choices=list(SOURCES),
                        help="; ".join(f"{kind.name}: {kind.summary}" for kind in SOURCES.values()))
    labels = list(dict.fromkeys(label for kind in SOURCES.values() for label in kind.labels))
    parser.add_argument("--labels", default="none", choices=labels,
                        help="; ".join(f"{kind.name}: {', '.join(kind.labels[1:])}" for kind in SOURCES.values()
                                       if len(kind.labels) > 1) + "; default none (unlabelled)")
    flags: dict[str, tuple[Flag, dict[str, list[str]]]] = {}  # name -> (flag, help -> sources)
    for kind in SOURCES.values():
        for flag in kind.flags:
            flags.setdefault(flag.name, (flag, {}))[1].setdefault(flag.help, []).append(kind.name)
    for name, (flag, helps) in flags.items():
        parser.add_argument(name, help="; ".join(f"{', '.join(names)}: {text}" for text, names in helps.items()),
                            **flag.options)


def check_labels(args: argparse.Namespace) -> None:
    allowed = source_kind(args.source).labels
    if args.labels not in allowed:
        raise ValueError(f"--labels {args.labels} does not apply to --source {args.source}; choose one of {allowed}")

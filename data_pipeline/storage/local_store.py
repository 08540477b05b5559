"""A shard set in a local (or network-mounted POSIX) directory, read by byte range.

Each process keeps one read-only handle per shard it touches, up to the set's shard count (14,198
at ImageNet-21K; ``open_files`` raises the soft limit for them), so a random order over all shards
costs one open per shard per process, not one per sample: 64 ranks at 1,000 images/s no longer ask
a shared filesystem's metadata servers for 64,000 opens a second.  ``os.pread`` carries its own
offset, so threads share a handle.

Forks: a DataLoader worker inherits the handles its parent had open (a descriptor survives ``fork``
and ``pread`` moves no shared position), and ``open_all`` lets a loader open every shard before its
workers fork.  Handles a worker opens itself close when the worker exits at the end of its pass.
"""

from __future__ import annotations

import os
from pathlib import Path

from data_pipeline.storage.open_files import ensure_open_files
from data_pipeline.storage.read_stats import read_stats

_room: dict[str, int] = {}  # shards per local set this process reads: what RLIMIT_NOFILE must fit


class LocalStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._handles: dict[str, int] = {}
        self._version: int | None = None

    def executor(self) -> None:
        """None: each reader reads on its own threads (``data.loader.num_threads``)."""
        return None

    def describe(self, relative: str) -> str:
        return str(self.root / relative)

    def __getstate__(self) -> dict:
        """Pickled into a process started by spawn or forkserver (a DataLoader worker in a process
        that a forkserver started, Python 3.14's default): handle numbers mean nothing there, or
        another file, so it opens its own, with room for them."""
        return {"root": self.root, "shards": _room.get(str(self.root), 0)}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["root"])
        if state["shards"]:
            self.make_room(state["shards"])

    def make_room(self, shards: int) -> None:
        """Let this process keep ``shards`` handles of this set open, beside those of its other sets
        (a training set, a held-out set and a kNN bank may all be local)."""
        _room[str(self.root)] = max(shards, _room.get(str(self.root), 0))
        ensure_open_files(sum(_room.values()), ", ".join(_room))

    def _handle(self, relative: str) -> int:
        handle = self._handles.get(relative)
        if handle is not None:
            return handle
        # No lock (a lock held by a reading thread at a DataLoader fork would stay locked in the
        # worker): two threads opening one shard keep the first handle and close the other.
        opened = os.open(self.root / relative, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        read_stats().count("opens")
        handle = self._handles.setdefault(relative, opened)
        if handle != opened:
            os.close(opened)
        return handle

    def renew(self, version: int) -> None:
        """Read the set of manifest ``version`` (its mtime): when it changed, the set was rewritten in
        place, and shards open afresh.  The old handles stay open, as a thread may still be reading
        through one (closing it could hand its number to another file); they go at the process's end."""
        if version != self._version:
            self._version, self._handles = version, {}

    def open_all(self, relatives: list[str]) -> None:
        for relative in relatives:
            self._handle(relative)

    def read_range(self, relative: str, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` (fewer when the file is shorter: the caller names the damage)."""
        handle = self._handle(relative)
        stats = read_stats()
        with stats.request():
            data = os.pread(handle, size, offset)
        stats.add_bytes(len(data))
        return data

    def read_bytes(self, relative: str) -> bytes:
        return (self.root / relative).read_bytes()

    def close(self) -> None:
        handles, self._handles = self._handles, {}
        for handle in handles.values():
            os.close(handle)

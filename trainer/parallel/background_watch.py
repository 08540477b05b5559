"""A daemon thread that runs a watch for the length of a ``with`` block (the launcher's watches of its
ranks' reports while torchrun runs)."""

from __future__ import annotations

import threading


class BackgroundWatch:
    """Subclasses define ``_watch`` and wait on ``self._done`` between looks; ``__exit__`` ends it."""

    thread_name = "watch"

    def __init__(self) -> None:
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=self.thread_name, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()

    def _watch(self) -> None:
        raise NotImplementedError

"""``open_store(location)``: the process's store for a shard set, a ``LocalStore`` for a directory or
an ``S3Store`` for ``s3://``; one per location and settings, so every loader of a process shares its
handles, client and connection pool."""

from __future__ import annotations

import threading
from pathlib import Path

from data_pipeline.storage.local_store import LocalStore
from data_pipeline.storage.s3_store import S3Store
from data_pipeline.storage.shard_url import S3Url, ShardLocation, shard_location
from data_pipeline.storage.storage_settings import StorageSettings, storage_settings

Store = LocalStore | S3Store
_stores: dict[tuple[str, StorageSettings | None], Store] = {}
_lock = threading.Lock()


def open_store(location: ShardLocation | str, settings: StorageSettings | None = None) -> Store:
    location = shard_location(location)
    if isinstance(location, S3Url):
        settings = settings or storage_settings()
        key = (str(location), settings)
    else:
        location, key = Path(location).resolve(), (str(Path(location).resolve()), None)
    with _lock:
        store = _stores.get(key)
        if store is None:
            store = S3Store(location, settings) if isinstance(location, S3Url) else LocalStore(location)
            _stores[key] = store
        return store


def forget_stores() -> None:
    """Drop this process's stores (their handles close; S3 clients are made anew on next use): for
    a process that changes its credentials or settings, and for tests."""
    with _lock:
        for store in _stores.values():
            if isinstance(store, LocalStore):
                store.close()
        _stores.clear()

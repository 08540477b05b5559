"""A shard set under ``s3://bucket/prefix``, read by ranged GETs of exactly a sample's bytes.

Concurrency comes from the caller (``StepReader`` reads a step's samples on ``max_in_flight``
threads, steps ahead of the one training); the client's connection pool is as large.  Failures:

- the store does not answer (refused, reset, timed out, 5xx): retried with exponential backoff
  (0.1 s doubling to 5 s) and counted, for ``outage_retry_s`` once this process has reached the store,
  for ``connect_timeout_s`` before it ever has (a wrong endpoint fails in seconds, not minutes);
  then ``StorageUnavailableError`` (exit 1: the Job retries, and the run resumes from its checkpoint);
- refused or missing credentials: ``StorageAccessError`` at once;
- a missing bucket or object: ``FileNotFoundError`` naming the URL;
- a range past the object's end (a tar shorter than its index): the bytes there are, as a local
  file would give, and the sample table names the damage.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from data_pipeline.storage.read_stats import read_stats
from data_pipeline.storage.s3_clients import BAD_RANGE, DENIED, NO_BUCKET, NO_KEY, TRANSIENT, ProcessClient
from data_pipeline.storage.shard_url import S3Url
from data_pipeline.storage.storage_errors import (
    CREDENTIALS_HELP,
    BucketNotFoundError,
    StorageAccessError,
    StorageUnavailableError,
)
from data_pipeline.storage.storage_settings import StorageSettings

FIRST_BACKOFF_S, MAX_BACKOFF_S = 0.1, 5.0
_executor_lock = threading.Lock()


class S3Store:
    def __init__(self, url: S3Url, settings: StorageSettings) -> None:
        self.url, self.settings = S3Url(url), settings
        self._client = ProcessClient(settings)
        self._reached = False  # a request of this process got an answer: later failures are outages
        self._executor: tuple[int, ThreadPoolExecutor] | None = None

    def __getstate__(self) -> dict:
        """Pickled into a spawned process: its client and threads are made there, on first use."""
        return {"url": self.url, "settings": self.settings}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["url"], state["settings"])

    def executor(self) -> ThreadPoolExecutor:
        """The process's ``max_in_flight`` threads for this store's reads, shared by every reader of it
        (a training and an evaluation loader, the steps read ahead), so that the requests in flight
        never outnumber the connection pool; made anew after a fork."""
        owner = self._executor
        if owner is None or owner[0] != os.getpid():
            with _executor_lock:
                owner = self._executor
                if owner is None or owner[0] != os.getpid():
                    owner = (os.getpid(), ThreadPoolExecutor(self.settings.max_in_flight, thread_name_prefix="s3-read"))
                    self._executor = owner
        return owner[1]

    def describe(self, relative: str) -> str:
        return self.url.child(relative) if relative else str(self.url)

    def make_room(self, shards: int) -> None:
        """Nothing to open: every read is a request."""

    def renew(self, version: int) -> None:
        """Nothing is kept per object."""

    def open_all(self, relatives: list[str]) -> None:
        """Nothing to open: every read is a request."""

    def _call(self, relative: str, action: str, request):
        """``request(client)`` with the retries and error mapping of the module docstring."""
        stats, url = read_stats(), self.describe(relative)
        deadline, backoff, first_failure = None, FIRST_BACKOFF_S, None
        while True:
            client = self._client.get()
            try:
                with stats.request():
                    result = request(client)
                self._reached = True
                return result
            except Exception as error:  # the client's own types, classified below
                kind = client.classify(error)
                if kind == TRANSIENT:
                    now = time.monotonic()
                    budget = self.settings.outage_retry_s if self._reached else self.settings.connect_timeout_s
                    first_failure = now if first_failure is None else first_failure
                    deadline = now + budget if deadline is None else deadline
                    if now < deadline:
                        stats.count("retries")
                        time.sleep(min(backoff, max(0.0, deadline - now)))
                        backoff = min(backoff * 2, MAX_BACKOFF_S)
                        continue
                stats.count("errors")
                if kind == BAD_RANGE:
                    return b""
                retried = time.monotonic() - first_failure if first_failure is not None else 0.0
                raise self._explain(kind, url, action, error, retried) from error

    def _explain(self, kind: str, url: str, action: str, error: BaseException, retried_s: float) -> Exception:
        endpoint = self.settings.describe_endpoint()
        if kind == TRANSIENT:
            hint = ("check data.storage.endpoint_url (or AWS_ENDPOINT_URL_S3) and that the store is up"
                    if not self._reached else "the store stopped answering; the run resumes from its last checkpoint "
                    "once it is back")
            limit = ("data.storage.outage_retry_s", self.settings.outage_retry_s) if self._reached else (
                "data.storage.connect_timeout_s", self.settings.connect_timeout_s)
            return StorageUnavailableError(f"{url}: cannot {action} at {endpoint}: no answer after retrying for "
                                           f"{retried_s:.1f} s ({limit[0]}={limit[1]:g}; {type(error).__name__}: "
                                           f"{error}); {hint}")
        if kind == DENIED:
            return StorageAccessError(f"{url}: {endpoint} refused the request's credentials ({error}); "
                                      f"{CREDENTIALS_HELP}")
        if kind == NO_BUCKET:
            return BucketNotFoundError(f"{url}: bucket {self.url.bucket!r} does not exist at {endpoint}; check the URL "
                                     "and data.storage.endpoint_url")
        if kind == NO_KEY:
            return FileNotFoundError(f"{url} not found at {endpoint}")
        return OSError(f"{url}: cannot {action} at {endpoint}: {type(error).__name__}: {error}")

    def read_range(self, relative: str, offset: int, size: int) -> bytes:
        key = self.url.key(relative)
        data = self._call(relative, "read", lambda client: client.get_range(self.url.bucket, key, offset, size))
        read_stats().add_bytes(len(data))
        return data

    def read_bytes(self, relative: str) -> bytes:
        key = self.url.key(relative)
        data = self._call(relative, "read", lambda client: client.get(self.url.bucket, key))
        read_stats().add_bytes(len(data))
        return data

    def exists(self, relative: str) -> bool:
        try:
            self.read_range(relative, 0, 1)
        except BucketNotFoundError:
            raise
        except FileNotFoundError:
            return False
        return True

    def download(self, relative: str, destination: Path) -> None:
        """The object into ``destination``, atomically (a rename of a finished temp file)."""
        data = self.read_bytes(relative)
        destination = Path(destination)
        destination.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=destination.parent, prefix=f".{destination.name}.")
        try:
            with os.fdopen(handle, "wb") as out:
                out.write(data)
            os.replace(tmp, destination)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def upload(self, source: Path, relative: str) -> None:
        key = self.url.key(relative)
        self._call(relative, "write", lambda client: client.put_file(self.url.bucket, key, str(source)))

    def list(self, relative_prefix: str = "") -> dict[str, int]:
        """``{relative path: size}`` of the objects under the set's prefix (or a sub-prefix of it)."""
        prefix = self.url.key(relative_prefix) + "/" if relative_prefix else (self.url.prefix + "/" if self.url.prefix
                                                                               else "")
        found = self._call(relative_prefix, "list", lambda client: client.list(self.url.bucket, prefix))
        base = self.url.prefix + "/" if self.url.prefix else ""
        return {key[len(base):]: size for key, size in found}

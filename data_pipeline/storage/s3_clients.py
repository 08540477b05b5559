"""The two S3 clients ``data.storage.client`` chooses between, behind the four calls a shard store
makes (a ranged GET, a whole GET, a PUT from a file, a listing) and one error classifier.

- ``boto3`` (default): AWS's own SDK.  Every request has its own connect and read timeouts, its
  errors carry the HTTP status and S3 error code, and its credential chain is the AWS CLI's (web
  identity included).  Each call spends about a millisecond of Python CPU, which a pool of
  ``max_in_flight`` threads overlaps with the store's latency.
- ``s3torchconnector``: AWS's CRT-based client for PyTorch.  Its public readers fetch 8 MiB per
  small read (``range_based()``, unless ``buffer_size=0``), so arbitrary (key, offset, size) reads
  go through its native client (``S3Client._client``, not a public API); it retries inside the
  native client and has no per-request timeout.

``instcls bench data --storage`` measures both against the same store (docs/benchmarks.md has the
figures, docs/data.md why boto3 is the default).  Requests are never signed by hand: each client signs its own.
"""

from __future__ import annotations

import socket
import threading

from data_pipeline.storage.storage_errors import CREDENTIALS_HELP, StorageAccessError
from data_pipeline.storage.storage_settings import StorageSettings

# What an error means for a read: retry it (the store may come back), or stop with what to fix.
TRANSIENT, DENIED, NO_BUCKET, NO_KEY, BAD_RANGE, OTHER = "transient", "denied", "no-bucket", "no-key", "range", "other"


class Boto3Client:
    def __init__(self, settings: StorageSettings) -> None:
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        session = boto3.session.Session()
        if not settings.unsigned and session.get_credentials() is None:
            raise StorageAccessError(f"no S3 credentials were found for {settings.describe_endpoint()}: "
                                     f"{CREDENTIALS_HELP}")
        config = Config(
            region_name=settings.resolved_region,
            signature_version=UNSIGNED if settings.unsigned else None,
            s3={"addressing_style": "path" if settings.path_style else "virtual"},
            max_pool_connections=settings.max_in_flight,
            connect_timeout=settings.connect_timeout_s, read_timeout=settings.read_timeout_s,
            retries={"total_max_attempts": 1, "mode": "standard"},  # the store retries, counting each
            tcp_keepalive=True,
        )
        self._s3 = session.client("s3", endpoint_url=settings.resolved_endpoint, config=config)

    def get_range(self, bucket: str, key: str, offset: int, size: int) -> bytes:
        if size == 0:
            return b""
        response = self._s3.get_object(Bucket=bucket, Key=key, Range=f"bytes={offset}-{offset + size - 1}")
        return response["Body"].read()

    def get(self, bucket: str, key: str) -> bytes:
        return self._s3.get_object(Bucket=bucket, Key=key)["Body"].read()

    def put_file(self, bucket: str, key: str, path: str) -> None:
        with open(path, "rb") as handle:
            self._s3.put_object(Bucket=bucket, Key=key, Body=handle)

    def list(self, bucket: str, prefix: str) -> list[tuple[str, int]]:
        """``(key, size)`` of every object under ``prefix``."""
        found = []
        for page in self._s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found += [(item["Key"], item["Size"]) for item in page.get("Contents", [])]
        return found

    @staticmethod
    def classify(error: BaseException) -> str:
        from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError
        from botocore.exceptions import ConnectionError as BotoConnectionError

        if isinstance(error, ClientError):
            code = str(error.response.get("Error", {}).get("Code", ""))
            status = int(error.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
            if code == "NoSuchBucket":
                return NO_BUCKET
            if code in ("NoSuchKey", "404", "NotFound") or status == 404:
                return NO_KEY
            if code == "InvalidRange" or status == 416:
                return BAD_RANGE
            if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
                return DENIED
            if status >= 500 or code in ("SlowDown", "RequestTimeout", "ServiceUnavailable", "InternalError"):
                return TRANSIENT
            return OTHER
        # Refused, reset or closed connections, timeouts and bodies cut off mid-read: the network or
        # the store, which may come back.  A local fault (a staged file missing) is not one of them.
        from urllib3.exceptions import HTTPError as Urllib3Error

        network = (BotoConnectionError, HTTPClientError, IncompleteReadError, Urllib3Error, ConnectionError,
                   TimeoutError, socket.timeout)
        return TRANSIENT if isinstance(error, network) else OTHER


CRT_GBPS_PER_CONNECTION = 0.4  # at 25.6 Gbit/s it kept 64 connections (`instcls bench data --client ...`)


class CrtClient:
    """s3torchconnector's native client, one per process (it warns when one is alive at a fork)."""

    def __init__(self, settings: StorageSettings) -> None:
        from s3torchconnector._s3client import S3Client, S3ClientConfig

        # The CRT client opens connections in proportion to its throughput target: at its default
        # 10 Gbit/s it kept 25 connections for 64 reads in flight (`instcls bench data`), so the
        # target follows max_in_flight.
        config = S3ClientConfig(force_path_style=settings.path_style, unsigned=settings.unsigned, max_attempts=3,
                                throughput_target_gbps=max(10.0, CRT_GBPS_PER_CONNECTION * settings.max_in_flight))
        self._client = S3Client(settings.resolved_region, endpoint=settings.resolved_endpoint, s3client_config=config)

    def get_range(self, bucket: str, key: str, offset: int, size: int) -> bytes:
        if size == 0:
            return b""
        return b"".join(self._client._client.get_object(bucket, key, offset, offset + size))

    def get(self, bucket: str, key: str) -> bytes:
        return b"".join(self._client._client.get_object(bucket, key))

    def put_file(self, bucket: str, key: str, path: str) -> None:
        with open(path, "rb") as handle:
            writer = self._client.put_object(bucket, key)
            try:
                while block := handle.read(8 << 20):
                    writer.write(block)
            finally:
                writer.close()

    def list(self, bucket: str, prefix: str) -> list[tuple[str, int]]:
        found = []
        for page in self._client.list_objects(bucket, prefix):
            found += [(info.key, info.size) for info in page.object_info]
        return found

    @staticmethod
    def classify(error: BaseException) -> str:
        from s3torchconnectorclient import S3Exception

        if not isinstance(error, S3Exception):
            return OTHER
        text = str(error)
        if "NoSuchBucket" in text or "bucket does not exist" in text:
            return NO_BUCKET
        if "NoSuchKey" in text or "Not Found" in text or "404" in text:
            return NO_KEY
        if "InvalidRange" in text or "416" in text:
            return BAD_RANGE
        if "Forbidden" in text or "AccessDenied" in text or "403" in text or "credentials" in text.lower():
            return DENIED
        return TRANSIENT


_CLIENTS = {"boto3": Boto3Client, "s3torchconnector": CrtClient}
_lock = threading.Lock()


class ProcessClient:
    """One client per process, made on first use: a DataLoader worker forked from a process that
    had one makes its own (a client's connection pool and threads do not survive a fork), and DALI's
    reading thread shares its process's."""

    def __init__(self, settings: StorageSettings) -> None:
        self.settings = settings
        self._owner: tuple[int, object] | None = None

    def get(self):
        import os

        owner = self._owner
        if owner is None or owner[0] != os.getpid():
            with _lock:
                owner = self._owner
                if owner is None or owner[0] != os.getpid():
                    owner = (os.getpid(), _CLIENTS[self.settings.client](self.settings))
                    self._owner = owner
        return owner[1]

"""How instcls reaches object storage: ``data.storage`` in a job config, ``StorageSettings`` here.

Credentials are never settings: the client finds them the way the AWS tools do (the
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` variables, ``AWS_PROFILE`` and the shared files,
or a pod's web identity through ``AWS_ROLE_ARN`` + ``AWS_WEB_IDENTITY_TOKEN_FILE``).  The endpoint
and region default to their standard variables; path-style addressing has none, so it follows the
endpoint: path style for a custom endpoint (what S3-compatible stores serve), virtual hosts on AWS.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

S3_CLIENTS = ("boto3", "s3torchconnector")
ADDRESSING = ("auto", "path", "virtual")


@dataclass(frozen=True)
class StorageSettings:
    """Attributes:
    endpoint_url: the S3 endpoint (``http://seaweedfs:8333``); unset: ``AWS_ENDPOINT_URL_S3``, then
        ``AWS_ENDPOINT_URL``, then AWS itself.
    region: unset: ``AWS_REGION``, then ``AWS_DEFAULT_REGION``, then us-east-1.
    addressing: "path" (``ENDPOINT/BUCKET/KEY``), "virtual" (``BUCKET.ENDPOINT/KEY``), or "auto":
        path with a custom endpoint, virtual on AWS.
    unsigned: send anonymous requests (a public bucket); otherwise a run without credentials is
        refused at start, naming where credentials come from.
    client: "boto3" (default) or "s3torchconnector"; ``instcls bench data`` measures both.
    max_in_flight: ranged GETs one process keeps in flight, on one pool of as many threads and
        connections shared by its readers (the torch loader's workers are processes of their own):
        the bytes of ``max_in_flight / latency`` samples a second.
    connect_timeout_s, read_timeout_s: one request's bounds.
    outage_retry_s: how long a read keeps retrying, with backoff, while the store does not answer
        (a restart, a network blip) before the run stops with exit 1, which the Job retries.
    table_cache_dir: where each node keeps the sample tables it downloaded (one copy per node,
        named by its SHA-256); unset: ``INSTCLS_TABLE_CACHE``, then the system's temp directory.
    """

    endpoint_url: str | None = None
    region: str | None = None
    addressing: str = "auto"
    unsigned: bool = False
    client: str = "boto3"
    max_in_flight: int = 64
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 30.0
    outage_retry_s: float = 120.0
    table_cache_dir: str | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, fix: str) -> None:
            if not ok:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: {fix}")

        need(self.addressing in ADDRESSING, "addressing", f"choose one of {ADDRESSING}")
        need(self.client in S3_CLIENTS, "client", f"choose one of {S3_CLIENTS}")
        need(self.max_in_flight >= 1, "max_in_flight", "use at least 1")
        for name in ("connect_timeout_s", "read_timeout_s"):
            need(getattr(self, name) > 0, name, "use a positive number of seconds")
        need(self.outage_retry_s >= 0, "outage_retry_s", "use 0 (no retry) or more seconds")
        need(self.endpoint_url is None or "://" in self.endpoint_url, "endpoint_url",
             "use a URL with its scheme: http://HOST:PORT or https://HOST")

    @property
    def resolved_endpoint(self) -> str | None:
        return self.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or None

    @property
    def resolved_region(self) -> str:
        return self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"

    @property
    def path_style(self) -> bool:
        if self.addressing == "auto":
            return self.resolved_endpoint is not None
        return self.addressing == "path"

    @property
    def resolved_table_cache(self) -> str:
        import tempfile

        return self.table_cache_dir or os.environ.get("INSTCLS_TABLE_CACHE") or os.path.join(
            tempfile.gettempdir(), "instcls-tables")

    def describe_endpoint(self) -> str:
        return self.resolved_endpoint or f"AWS S3 ({self.resolved_region})"


_current = StorageSettings()


def use_storage_settings(settings: StorageSettings) -> None:
    """Make ``settings`` this process's: the stores opened afterwards use them (a job's
    ``data.storage``; the trainer, the evaluation tools and make-shards call this at start)."""
    global _current
    _current = settings


def storage_settings() -> StorageSettings:
    return _current

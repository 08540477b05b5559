"""A shard set's location as a job config and the command line name it: a local directory, or
``s3://bucket/prefix`` on S3-compatible object storage.

Paths inside a shard set (a manifest's ``tar`` and ``index`` entries, ``../tars/x.tar`` for tars
indexed in place) resolve against either the same way: joined to the directory and normalised, so
a set copied between a disk and a bucket with any S3 tool (``aws s3 sync``, ``rclone``) is the same
set.  What such a copy must include: the directory and, for tars indexed in place, the tars'
directory beside it (with the same relative layout).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

SCHEME = "s3://"
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")


class S3Url(str):
    """``s3://bucket/prefix`` (no trailing slash): a shard set on object storage.  A ``str``, so it
    prints, compares and serialises (YAML, JSON, ``run.json``) as the URL the user wrote."""

    def __new__(cls, text: str) -> "S3Url":
        if not text.startswith(SCHEME):
            raise ValueError(f"{text!r} is not an s3:// URL: write s3://BUCKET/PREFIX")
        bucket, _, prefix = text[len(SCHEME):].partition("/")
        if not _BUCKET.match(bucket):
            raise ValueError(f"{text!r}: {bucket!r} is not an S3 bucket name (3-63 lowercase letters, digits, dots "
                             "and hyphens): write s3://BUCKET/PREFIX")
        prefix = posixpath.normpath(prefix).strip("/") if prefix.strip("/") else ""
        if prefix.startswith(".."):
            raise ValueError(f"{text!r}: the prefix climbs above the bucket")
        return super().__new__(cls, f"{SCHEME}{bucket}/{prefix}" if prefix else f"{SCHEME}{bucket}")

    @property
    def bucket(self) -> str:
        return self[len(SCHEME):].partition("/")[0]

    @property
    def prefix(self) -> str:
        """The key prefix, without a trailing slash ("" for the bucket's root)."""
        return self[len(SCHEME):].partition("/")[2]

    def key(self, relative: str) -> str:
        """The object key of ``relative`` (a manifest's path, ``../tars/x.tar`` included) under the prefix."""
        joined = posixpath.normpath(posixpath.join(self.prefix, relative)) if self.prefix else posixpath.normpath(
            relative)
        if joined.startswith("..") or joined.startswith("/") or joined == ".":
            raise ValueError(f"{self}: {relative!r} resolves outside the bucket {self.bucket!r}; the manifest's paths "
                             "must stay inside it")
        return joined

    def child(self, relative: str) -> "S3Url":
        return S3Url(f"{SCHEME}{self.bucket}/{self.key(relative)}")


ShardLocation = Path | S3Url


def is_s3(location: object) -> bool:
    return isinstance(location, str) and str(location).startswith(SCHEME)


def shard_location(value: str | Path) -> ShardLocation:
    """``S3Url`` for ``s3://...`` text, else a ``Path`` (``Path("s3://b")`` would fold the slashes)."""
    if isinstance(value, S3Url):
        return value
    if isinstance(value, str) and value.startswith(SCHEME):
        return S3Url(value)
    if isinstance(value, str) and re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*://", value):
        raise ValueError(f"{value!r}: only local paths and s3:// URLs name shard sets")
    return Path(value)

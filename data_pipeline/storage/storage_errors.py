"""Errors of a shard store, by what fixes them: ``StorageUnavailableError`` (the store did not
answer within its retry time; a retry of the job, once the store is back, does: exit 1) and
``StorageAccessError`` (credentials missing or refused: a person must fix them, exit 2).  A missing
bucket, prefix or object is a ``FileNotFoundError`` naming the URL."""

from __future__ import annotations


class StorageUnavailableError(ConnectionError):
    """The object store did not answer (connection refused or reset, timeouts, 5xx) for the whole
    retry time; the message names the URL, the endpoint and how long it was retried."""


class StorageAccessError(ValueError):
    """The store refused the request's credentials (403), or none were found."""


class BucketNotFoundError(FileNotFoundError):
    """The URL's bucket does not exist at the endpoint (a typo, or the wrong endpoint)."""


CREDENTIALS_HELP = ("give credentials the way the AWS tools read them: AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, "
                    "AWS_PROFILE with ~/.aws/credentials, or a pod's web identity (AWS_ROLE_ARN and "
                    "AWS_WEB_IDENTITY_TOKEN_FILE, k8s/components/s3); or set data.storage.unsigned=true for a "
                    "bucket that allows anonymous reads")

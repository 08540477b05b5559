"""The tests' S3 server: ``SeaweedServer`` (``weed mini`` on free loopback ports, see
``trainer.bench.seaweed_server``, which `instcls bench data --local-s3` starts too) and the keys a
signed one requires."""

from trainer.bench.seaweed_server import ACCESS_KEY, SECRET_KEY, SeaweedServer, weed_binary

__all__ = ["ACCESS_KEY", "SECRET_KEY", "SeaweedServer", "weed_binary"]

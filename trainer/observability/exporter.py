"""The ``/metrics`` endpoint of a training rank, at a bounded cost to training.

prometheus-client's own server renders the registry on a new thread for every request, inside
the training process; under many concurrent scrapers those threads hold the GIL often enough to
cost a CPU step a third of its throughput (``instcls bench exporter``).  This server answers one
request at a time from a cached rendering (refreshed at most every ``refresh_s``) and accepts at
most ``max_scrapes_per_s`` connections per second; scrapers beyond that wait in the kernel's
accept queue, which costs the training process nothing.  One Prometheus scrapes a target every
15-60 s, so the limit only ever bites a scrape storm.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

MAX_SCRAPES_PER_S = 20.0
REFRESH_S = 0.5
CLIENT_TIMEOUT_S = 2.0  # a client that sends nothing cannot hold the one serving thread longer


class _CachedRendering:
    def __init__(self, registry: CollectorRegistry, refresh_s: float) -> None:
        self.registry, self.refresh_s = registry, refresh_s
        self._body, self._rendered_at = b"", float("-inf")

    def body(self) -> bytes:
        now = time.monotonic()
        if now - self._rendered_at >= self.refresh_s:
            self._body, self._rendered_at = generate_latest(self.registry), now
        return self._body


def _handler(rendering: _CachedRendering) -> type[BaseHTTPRequestHandler]:
    class MetricsRequest(BaseHTTPRequestHandler):
        timeout = CLIENT_TIMEOUT_S

        def do_GET(self) -> None:  # noqa: N802 (the http.server API)
            if self.path.split("?")[0] not in ("/", "/metrics"):
                self.send_error(404)
                return
            body = rendering.body()
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format, *args) -> None:  # scrapes are not news
            pass

    return MetricsRequest


class _Server(HTTPServer):
    def __init__(self, address: str, port: int, handler) -> None:
        self.address_family = socket.AF_INET6 if ":" in address else socket.AF_INET
        super().__init__((address, port), handler)

    def handle_error(self, request, client_address) -> None:
        """A scraper that gave up mid-answer (timeout, reset) is its own business, not a traceback."""
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def serve_bounded(registry: CollectorRegistry, port: int, address: str = "0.0.0.0",
                  max_scrapes_per_s: float = MAX_SCRAPES_PER_S, refresh_s: float = REFRESH_S) -> HTTPServer:
    """Serve ``registry`` on ``address:port`` from a daemon thread; raises OSError if the port is taken."""
    server = _Server(address, port, _handler(_CachedRendering(registry, refresh_s)))
    spacing = 1.0 / max_scrapes_per_s

    def serve() -> None:
        while True:
            started = time.monotonic()
            server.handle_request()  # blocks in accept() without the GIL until a scraper connects
            time.sleep(max(0.0, spacing - (time.monotonic() - started)))

    threading.Thread(target=serve, name="metrics-exporter", daemon=True).start()
    return server

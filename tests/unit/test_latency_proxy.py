"""The bench's latency proxy delays every request of a keep-alive connection, not just its first,
and passes the bytes through unchanged both ways."""

import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from trainer.bench.latency_proxy import LatencyProxy

DELAY_MS = 150


class _Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients use it

    def do_GET(self):  # noqa: N802 - http.server's name
        body = self.path.encode() * 1000  # larger than one read of the proxy: the answer spans chunks
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_PUT(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body[::-1])

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def _timed_requests(endpoint: str, paths: list[str]) -> list[tuple[float, bytes]]:
    """Each path requested in turn on ONE connection: (seconds, body)."""
    host, port = endpoint[len("http://"):].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    timed = []
    for path in paths:
        started = time.perf_counter()
        connection.request("GET", path)
        body = connection.getresponse().read()
        timed.append((time.perf_counter() - started, body))
    connection.close()
    return timed


def test_every_request_on_a_kept_alive_connection_waits_the_delay(server):
    with LatencyProxy(server, DELAY_MS) as proxy:
        timed = _timed_requests(proxy.endpoint, ["/a", "/b", "/c"])
        assert proxy.client_connections() <= 1  # one connection carried the three (closed by now or not)
        assert proxy.cpu_seconds() > 0
    for (seconds, body), path in zip(timed, ["/a", "/b", "/c"]):
        assert body == path.encode() * 1000
        assert seconds >= DELAY_MS / 1e3, (path, seconds)


def test_without_a_delay_requests_pass_at_once_and_a_body_is_forwarded_whole(server):
    with LatencyProxy(server, 0) as proxy:
        timed = _timed_requests(proxy.endpoint, ["/a", "/b"])
        host, port = proxy.endpoint[len("http://"):].split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        payload = bytes(range(256)) * 1024
        connection.request("PUT", "/upload", body=payload)
        assert connection.getresponse().read() == payload[::-1]
        connection.close()
    assert all(seconds < DELAY_MS / 1e3 for seconds, _ in timed), timed


def test_the_proxy_refuses_an_endpoint_it_cannot_delay():
    with pytest.raises(ValueError, match="plain http:// only"):
        LatencyProxy("https://s3.example.com", 30)

"""The TrainJob status sender's thread outlives a broken reply.  A local HTTPS server with its own CA
answers the first report with a truncated response (a Content-Length larger than the body it sends
before closing: ``http.client.IncompleteRead``, which is neither an ``OSError`` nor a ``URLError``),
then answers properly: the next report still arrives, and the failure is warned about once."""

from __future__ import annotations

import http.server
import json
import ssl
import threading
import time

import trustme

from trainer.observability.trainjob_status import TrainJobStatusReporter


class TruncatingServer(http.server.ThreadingHTTPServer):
    def __init__(self, context: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), TruncatingHandler)
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.bodies: list[dict] = []
        self.first_answered = threading.Event()


class TruncatingHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self) -> None:  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.server.bodies.append(json.loads(body))
        first = len(self.server.bodies) == 1
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body) + 100) if first else str(len(body)))
        self.end_headers()
        self.wfile.write(body[:5] if first else body)  # the first reply stops short of its length
        self.close_connection = True
        if first:
            self.server.first_answered.set()

    def log_message(self, *args) -> None:
        pass


def _wait_for(condition, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_truncated_reply_is_warned_once_and_the_next_report_still_arrives(tmp_path):
    ca = trustme.CA()
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(context)
    ca.cert_pem.write_to_path(str(tmp_path / "ca.crt"))
    (tmp_path / "token").write_text("token\n")
    server = TruncatingServer(context)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    warnings: list[str] = []
    reporter = TrainJobStatusReporter(f"https://127.0.0.1:{server.server_address[1]}/status", str(tmp_path / "ca.crt"),
                                      str(tmp_path / "token"), last_step=4, every_s=0, warn=warnings.append,
                                      timeout_s=5)
    try:
        reporter.log_step(1, {"loss": 2.0})
        assert server.first_answered.wait(10)
        # the first report is done with (failed and warned, or its thread ended) before the next is queued,
        # so that the sender cannot fold the two into one
        _wait_for(lambda: reporter.failed or not reporter._thread.is_alive())
        reporter.log_step(2, {"loss": 1.0})
        _wait_for(lambda: len(server.bodies) >= 2, timeout_s=5)
        reporter.close(4, {"loss": 0.5})
    finally:
        server.shutdown()
    progress = [body["trainerStatus"]["progressPercentage"] for body in server.bodies]
    assert progress[0] == 25 and progress[-1] == 100, progress
    assert reporter.sent >= 1 and reporter.failed == 1
    assert len(warnings) == 1 and "did not take the progress report: IncompleteRead" in warnings[0], warnings

"""A run's progress in its Kubeflow Trainer TrainJob's status (``logging.trainjob_status``).

Kubeflow Trainer (v2.2 on, behind the ``TrainJobStatus`` feature gate; read here from v2.3.0's
``pkg/runtime/framework/plugins/trainjobstatus`` and ``pkg/statusserver``) injects three variables
into the trainer's pods: the status endpoint's URL
(``https://...svc:PORT/apis/trainer.kubeflow.org/v1alpha1/namespaces/NS/trainjobs/NAME/status``),
the path of the CA certificate that signs it and the path of a projected service-account token
(audience ``trainer.kubeflow.org/...``, rotated: read again for every request).  The controller
copies what a pod POSTs, an ``UpdateTrainJobStatusRequest``, into ``status.trainerStatus``:
``progressPercentage`` (0-100), ``estimatedRemainingSeconds``, ``metrics`` (name and value, both
strings) and ``lastUpdatedTime``, which ``kubectl get trainjob`` and the Kubeflow UI show.

Rank 0 reports at log steps, at most every ``logging.progress_every_s``, from a background thread
that sends only the newest report: a slow or unreachable endpoint never holds a step.  A failed or
refused POST, or a broken reply (any exception), logs one warning for the run; the thread still sends
the later reports, and training goes on.
"""

from __future__ import annotations

import datetime
import json
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable

from trainer.observability.progress import RunPace

URL_ENV = "KUBEFLOW_TRAINER_SERVER_URL"
CA_ENV = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
TOKEN_ENV = "KUBEFLOW_TRAINER_SERVER_TOKEN"
MAX_METRICS = 256  # the API's limit on trainerStatus.metrics


def status_request(progress: float, remaining_s: float | None, metrics: dict[str, float],
                   now: datetime.datetime) -> dict:
    """The ``UpdateTrainJobStatusRequest`` body: ``progress`` in [0, 1], ``metrics`` by name."""
    named = [{"name": name[:64], "value": f"{value:.6g}"} for name, value in metrics.items()]
    status = {"progressPercentage": int(min(100, max(0, round(100 * progress)))), "metrics": named[:MAX_METRICS],
              "lastUpdatedTime": now.astimezone(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}
    if remaining_s is not None:
        status["estimatedRemainingSeconds"] = int(max(0, round(remaining_s)))
    return {"trainerStatus": status}


class TrainJobStatusReporter:
    """Reports ``log_step``'s figures to the status endpoint; ``close`` sends the last one."""

    def __init__(self, url: str, ca_file: str, token_file: str, last_step: int, every_s: float,
                 warn: Callable[[str], None], clock: Callable[[], float] = time.monotonic,
                 timeout_s: float = 10) -> None:
        self.url, self.ca_file, self.token_file = url, ca_file, token_file
        self.last_step, self.warn, self.timeout_s = last_step, warn, timeout_s
        self.pace = RunPace(last_step, every_s, clock)
        self.sent = self.failed = 0
        self._pending: dict | None = None
        self._closing = False
        self._wake = threading.Condition()
        self._thread = threading.Thread(target=self._send_loop, name="trainjob-status", daemon=True)
        self._thread.start()

    @classmethod
    def from_environment(cls, last_step: int, every_s: float, warn: Callable[[str], None],
                         environ=os.environ) -> TrainJobStatusReporter | None:
        """The reporter for this pod, or None (with one warning) where the runtime injected no endpoint."""
        missing = [name for name in (URL_ENV, CA_ENV, TOKEN_ENV) if not environ.get(name)]
        if missing:
            warn(f"logging.trainjob_status is on, but {', '.join(missing)} is not set: this pod's TrainJob runtime "
                 "injects no status endpoint (Kubeflow Trainer v2.2 or later, with the TrainJobStatus feature gate); "
                 "progress is not reported. Turn the gate on, or set logging.trainjob_status=false")
            return None
        return cls(environ[URL_ENV], environ[CA_ENV], environ[TOKEN_ENV], last_step, every_s, warn)

    def log_step(self, step: int, metrics: dict[str, float]) -> None:
        """A log step's figures; reported if ``every_s`` has passed since the last report."""
        now = self.pace.due(step)
        if now is not None:
            self._queue(step, metrics, now)

    def _queue(self, step: int, metrics: dict[str, float], now: float) -> None:
        remaining = self.pace.remaining_seconds(now, step)
        body = status_request(step / self.last_step if self.last_step else 1.0, remaining, metrics,
                              datetime.datetime.now(datetime.timezone.utc))
        with self._wake:
            self._pending = body  # only the newest matters
            self._wake.notify()

    def close(self, step: int | None = None, metrics: dict[str, float] | None = None) -> None:
        """Send the final figures (``step``: where the run ended) and stop the thread."""
        if step is not None:
            self._queue(step, metrics or {}, self.pace.clock())
        with self._wake:
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout=self.timeout_s + 5)

    def _send_loop(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closing:
                    self._wake.wait()
                body, self._pending = self._pending, None
                closing = self._closing
            if body is not None:
                self._post(body)
            if closing and body is None:
                return

    def _post(self, body: dict) -> None:
        try:
            token = Path(self.token_file).read_text().strip()  # projected tokens rotate: read each time
            request = urllib.request.Request(self.url, data=json.dumps(body).encode(), method="POST", headers={
                "Authorization": f"Bearer {token}", "Content-Type": "application/json"})
            context = ssl.create_default_context(cafile=self.ca_file)
            with urllib.request.urlopen(request, context=context, timeout=self.timeout_s) as response:
                response.read()
            self.sent += 1
        except Exception as error:  # noqa: BLE001 - a broken reply (IncompleteRead) must not end the thread
            self.failed += 1
            if self.failed == 1:
                reason = (f"HTTP {error.code} {error.reason}" if isinstance(error, urllib.error.HTTPError)
                          else f"{type(error).__name__}: {error}")
                self.warn(f"warning: the TrainJob's status endpoint ({self.url}) did not take the progress report: "
                          f"{reason}. Training goes on; later reports are still sent, and this warning is not repeated")

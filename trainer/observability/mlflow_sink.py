"""The run in MLflow (``logging.mlflow``): rank 0's JSON log mirrored into one MLflow run.

What it logs, through MLflow's own client (``MlflowClient``; the ``mlflow-skinny`` package):
- params: the resolved config, flattened (``optim.base_lr``), once.  MLflow refuses a param whose
  value changes, so a resume with other settings (an elastic resize changes the per-rank batch)
  logs the new fields and records each changed one as a tag ``instcls.changed.FIELD`` =
  ``"OLD -> NEW at restart N"``;
- metrics: every scalar of the JSON log's ``step``, ``eval`` and ``summary`` records
  (``record_sinks.scalars_of``), at the record's step and wall time.  Steps trained again after a
  resume from an earlier checkpoint appear twice in a metric's history, as they do in the JSON log:
  both values are what the run did;
- tags: ``instcls.version``, ``instcls.git_commit``, ``instcls.image``, ``instcls.hosts``,
  ``instcls.data_digest``, ``instcls.world_size`` and ``instcls.restarts``, updated at every start;
- artifacts: ``run.json`` at each start, ``summary.json`` and ``model_card.md`` at the end;
- status: RUNNING while it trains; at its end FINISHED, KILLED when preempted (SIGTERM; the resume
  sets it RUNNING again), FAILED when the process ended without its summary record.

A resumed run continues the same MLflow run: its id is kept in each checkpoint's ``tracking.json``
(``trainer.checkpoint.tracking_state``).

Training never waits for the server.  Records go to a background thread, which sends them in
batches; each request gives up after ``logging.mlflow``'s timeout and retries
(``MlflowSettings.warning_bound_s``, 18 s with the defaults: MLflow's own defaults are 7 retries, a
120 s timeout, minutes).  The first request that gives up costs one warning; the thread keeps what
it could not send (up to ``MAX_PENDING_METRICS``) and tries again every ``RETRY_AFTER_S`` seconds, so
a server that comes back gets the whole history.  ``close`` waits at most ``CLOSE_WAIT_S`` for what is
queued.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path

from trainer.observability.record_sinks import scalars_of

MAX_PENDING_METRICS = 200_000  # ~10 bytes of Python per field, tens of MB at most: older ones are dropped
RETRY_AFTER_S = 30.0
CLOSE_WAIT_S = 30.0
BATCH_METRICS, BATCH_PARAMS, BATCH_TAGS = 1000, 100, 100  # MLflow's limits on one log_batch
PARAM_VALUE_CHARS, TAG_VALUE_CHARS = 6000, 8000
# The MLflow run's status when the process ends: finished or stopped at max_steps; preempted (a resume
# sets it RUNNING again); without a summary record, the run failed.
END_STATUS = {"finished": "FINISHED", "max_steps": "FINISHED", "sigterm": "KILLED"}


def flat_params(config) -> dict[str, str]:
    """The resolved config as ``{"section.field": "value"}``: dataclasses by field, lists and dicts as JSON."""
    flat: dict[str, str] = {}
    _flatten("", config, flat)
    return flat


def _flatten(prefix: str, value, into: dict[str, str]) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            _flatten(f"{prefix}{field.name}.", getattr(value, field.name), into)
        return
    key = prefix[:-1]
    if isinstance(value, (list, tuple, dict)):
        text = json.dumps(value, default=str)
    else:
        text = "" if value is None else str(value)
    into[key] = text[:PARAM_VALUE_CHARS]  # MLflow's limit on a param's value


def run_tags(provenance: dict, restarts: int) -> dict[str, str]:
    """The run's code, image, hosts and data, from its ``run.json``."""
    git = provenance.get("git") or {}
    commit = git.get("commit")
    tags = {
        "instcls.version": provenance.get("instcls_version"),
        "instcls.git_commit": f"{commit}{'-dirty' if git.get('dirty') else ''}" if commit else "unknown",
        "instcls.image": provenance.get("image") or "none",
        "instcls.hosts": ",".join(provenance.get("hosts") or []),
        "instcls.data_digest": (provenance.get("train_manifest") or {}).get("digest"),
        "instcls.world_size": provenance.get("world_size"),
        "instcls.restarts": restarts,
    }
    return {key: str(value)[:TAG_VALUE_CHARS] for key, value in tags.items() if value is not None}


def changed_params(logged: dict[str, str], params: dict[str, str], restarts: int) -> tuple[dict, dict]:
    """``(new params, tags)``: the fields the MLflow run has not logged yet, and a tag for each whose
    value differs from the logged one (MLflow keeps a param's first value)."""
    new = {key: value for key, value in params.items() if key not in logged}
    tags = {f"instcls.changed.{key}": f"{logged[key]} -> {value} at restart {restarts}"[:TAG_VALUE_CHARS]
            for key, value in params.items() if key in logged and logged[key] != value}
    return new, tags


THREAD_NAME = "instcls-mlflow"


class _FromTheTrackerThread(logging.Filter):
    """Drops the HTTP client's own log lines of the tracker's thread (urllib3 logs every
    retry as a warning): its one warning says what happened."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.threadName != THREAD_NAME


def quiet_client_logs(names=("urllib3.connectionpool", "urllib3.util.retry")) -> None:
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _FromTheTrackerThread) for existing in logger.filters):
            logger.addFilter(_FromTheTrackerThread())


def request_limits(timeout_s: float, retries: int, environ=os.environ) -> None:
    """MLflow's client reads its HTTP limits from the environment at every request: bounded ones,
    unless the user set them; a server's Retry-After (which may ask for an hour) is not obeyed."""
    for name, value in (("MLFLOW_HTTP_REQUEST_TIMEOUT", timeout_s), ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", retries),
                        ("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", 1), ("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", 1),
                        ("MLFLOW_HTTP_RESPECT_RETRY_AFTER_HEADER", "false")):
        environ.setdefault(name, str(int(value) if isinstance(value, float) and value.is_integer() else value))


class MlflowSink:
    """Rank 0's ``RecordSink`` for one MLflow run (``resumed_run_id``: the run a checkpoint names).

    ``run_id`` is the MLflow run's id once it is known (at once on a resume): the checkpoint keeps it."""

    def __init__(self, settings, params: dict[str, str], tags: dict[str, str], restarts: int,
                 resumed_run_id: str | None, warn: Callable[[str], None], client_factory=None) -> None:
        self.settings, self.params, self.tags, self.restarts = settings, params, tags, restarts
        self.run_id = resumed_run_id
        self.end_status = "FAILED"
        self.warn, self.warned = warn, False
        self._client_factory = client_factory or _mlflow_client
        self._items: queue.Queue = queue.Queue()
        self._pending_metrics: list = []
        self._pending_files: list[tuple[Path, str]] = []
        self._pending_status: str | None = None
        self._opened = False
        self._closed = False
        quiet_client_logs()
        self._thread = threading.Thread(target=self._serve, name=THREAD_NAME, daemon=True)
        self._thread.start()

    # -- the training thread's side: no request is made here ---------------------------------

    def write(self, record: dict) -> None:
        found = scalars_of(record)
        if found is not None:
            self._items.put(("metrics", found, int(record.get("time", time.time()) * 1000)))
        if record.get("event") == "summary":  # the run's end, and how: the MLflow run's status at close
            self.end_status = END_STATUS.get(record.get("stopped_by"), "FINISHED")

    def attach(self, path: Path, name: str) -> None:
        self._items.put(("file", Path(path), name))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._items.put(("close",))
        self._thread.join(timeout=CLOSE_WAIT_S)
        left = len(self._pending_metrics) + len(self._pending_files) + self._items.qsize() + bool(self._pending_status)
        if left and not self.warned:
            self._warn_once(f"{left} records or files were still queued after {CLOSE_WAIT_S:.0f} s")

    # -- the background thread -----------------------------------------------------------------

    def _serve(self) -> None:
        from mlflow.entities import Metric

        request_limits(self.settings.request_timeout_s, self.settings.retries)
        client, next_try = None, 0.0
        while True:
            backlog = self._backlog()
            try:  # with nothing to send, sleep until a record comes; else until the next try
                item = self._items.get(timeout=max(0.0, next_try - time.monotonic()) if backlog else None)
            except queue.Empty:
                item = None
            closing = False
            while item is not None:  # everything queued: one request carries many records
                if item[0] == "close":
                    closing = True
                    self._pending_status = self.end_status
                    break
                self._take(item, Metric)
                try:
                    item = self._items.get_nowait()
                except queue.Empty:
                    item = None
            if self._backlog() and (closing or time.monotonic() >= next_try):
                try:
                    client = client or self._client_factory(self.settings.tracking_uri)
                    self._deliver(client)
                except Exception as error:  # noqa: BLE001 - the server's problem never ends the run
                    lines = str(error).strip().splitlines()
                    self._warn_once(f"{type(error).__name__}: {lines[0][:300] if lines else ''}")
                    next_try = time.monotonic() + RETRY_AFTER_S
            if closing:
                return

    def _backlog(self) -> bool:
        return bool(self._pending_metrics or self._pending_files or self._pending_status or not self._opened)

    def _take(self, item: tuple, metric_type) -> None:
        if item[0] == "metrics":
            (step, scalars), millis = item[1], item[2]
            self._pending_metrics.extend(metric_type(key, value, millis, step) for key, value in scalars.items())
            if len(self._pending_metrics) > MAX_PENDING_METRICS:
                del self._pending_metrics[:len(self._pending_metrics) - MAX_PENDING_METRICS]
        elif item[0] == "file":
            self._pending_files.append((item[1], item[2]))

    def _deliver(self, client) -> None:
        if not self._opened:
            self._open_run(client)
        while self._pending_metrics:
            batch = self._pending_metrics[:BATCH_METRICS]
            client.log_batch(self.run_id, metrics=batch)
            del self._pending_metrics[:len(batch)]
        while self._pending_files:
            path, name = self._pending_files[0]
            _log_file(client, self.run_id, path, name)
            self._pending_files.pop(0)
        if self._pending_status is not None:
            client.set_terminated(self.run_id, status=self._pending_status)
            self._pending_status = None

    def _open_run(self, client) -> None:
        """The run a checkpoint named, or a new one; its params and tags."""
        from mlflow.entities import Param, RunTag

        logged: dict[str, str] = {}
        tags = dict(self.tags)
        if self.run_id is not None:
            try:
                logged = dict(client.get_run(self.run_id).data.params)
                client.update_run(self.run_id, status="RUNNING")  # it ended KILLED (preempted) or FAILED
            except Exception as error:
                if getattr(error, "error_code", None) != "RESOURCE_DOES_NOT_EXIST":
                    raise
                tags["instcls.resumed_from_mlflow_run"] = self.run_id  # another server, or the run was deleted
                self.run_id = None
        if self.run_id is None:
            experiment = client.get_experiment_by_name(self.settings.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else client.create_experiment(self.settings.experiment))
            run = client.create_run(experiment_id, run_name=self.settings.run_name or None)
            self.run_id = run.info.run_id
        params, changed = changed_params(logged, self.params, self.restarts)
        tags.update(changed)
        param_items = [Param(key, value) for key, value in params.items()]
        tag_items = [RunTag(key, value) for key, value in tags.items()]
        for start in range(0, max(len(param_items), len(tag_items)), BATCH_PARAMS):
            client.log_batch(self.run_id, params=param_items[start:start + BATCH_PARAMS],
                             tags=tag_items[start:start + BATCH_TAGS])
        self._opened = True

    def _warn_once(self, reason: str) -> None:
        if self.warned:
            return
        self.warned = True
        self.warn(f"warning: MLflow at {self.settings.tracking_uri} did not take the run's records within "
                  f"{self.settings.warning_bound_s:.0f} s ({reason}). Training goes on; the JSON log keeps every "
                  f"record, the tracker tries again every {RETRY_AFTER_S:.0f} s, and this warning is not repeated")


def _mlflow_client(tracking_uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=tracking_uri)


def _log_file(client, run_id: str, path: Path, name: str) -> None:
    """``path`` as the artifact ``name`` (MLflow names an artifact by its file's name)."""
    import shutil
    import tempfile

    with tempfile.TemporaryDirectory(prefix="instcls-mlflow-") as folder:
        named = Path(folder) / name
        shutil.copyfile(path, named)
        client.log_artifact(run_id, str(named))


def open_mlflow_sink(settings, config, provenance: dict, restarts: int, resumed_run_id: str | None,
                     rank: int, warn: Callable[[str], None]) -> MlflowSink | None:
    """Rank 0's sink when ``logging.mlflow.tracking_uri`` is set; None elsewhere.  ``resumed_run_id``:
    the MLflow run the checkpoint it resumes names (``trainer.checkpoint.tracking_state``)."""
    if rank != 0 or not settings.enabled:
        return None
    return MlflowSink(settings, flat_params(config), run_tags(provenance, restarts), restarts, resumed_run_id, warn)

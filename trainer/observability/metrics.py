"""Prometheus metrics of one training rank (prometheus-client, served on port base + local_rank
by ``trainer.observability.exporter``, whose cost to training is bounded under scrape storms).

Base units (seconds, bytes), ``_total`` counters, a step-duration histogram.  Every series carries
a ``rank`` label so a dashboard can tell the ranks of a pod apart even before relabelling.
The registry is per process, never the library's global default.
"""

from __future__ import annotations

import errno

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from trainer.observability.exporter import serve_bounded

STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# A sample read: microseconds from a page cache, milliseconds from a disk or a bucket in the same
# zone, tens to hundreds of milliseconds from a distant or struggling store.
READ_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0)

# Every metric the exporter serves; the Grafana dashboard test checks its queries against this.
METRIC_NAMES = (
    "instcls_samples_processed_total",
    "instcls_step_duration_seconds",
    "instcls_data_wait_seconds_total",
    "instcls_step_phase_seconds_total",
    "instcls_loss",
    "instcls_learning_rate",
    "instcls_memory_bytes",
    "instcls_classifier_shard_bytes",
    "instcls_classifier_comm_seconds_total",
    "instcls_objective_metric",
    "instcls_epoch",
    "instcls_epoch_progress_ratio",
    "instcls_steps_per_epoch",
    "instcls_epochs_planned",
    "instcls_eval_knn_accuracy",
    "instcls_eval_failed",
    "instcls_bad_samples_skipped_total",
    "instcls_shard_read_requests_total",
    "instcls_shard_read_bytes_total",
    "instcls_shard_read_retries_total",
    "instcls_shard_read_errors_total",
    "instcls_shard_opens_total",
    "instcls_shard_read_seconds",
    "instcls_nonfinite_steps_skipped_total",
    "instcls_world_size",
    "instcls_restarts",
    "instcls_restart_steps_lost",
    "instcls_restart_stopped_seconds",
)


class TrainingMetrics:
    def __init__(self, rank: int) -> None:
        self.registry = CollectorRegistry()
        labels = ["rank"]
        r = self.registry

        def counter(name, doc):
            return Counter(name.removesuffix("_total"), doc, labels, registry=r).labels(str(rank))

        def gauge(name, doc, extra=()):
            g = Gauge(name, doc, labels + list(extra), registry=r)
            return g if extra else g.labels(str(rank))

        self.rank = str(rank)
        self.samples = counter("instcls_samples_processed_total", "Images consumed by training on this rank.")
        self.step_duration = Histogram(
            "instcls_step_duration_seconds", "Wall time of one training step.", labels, buckets=STEP_BUCKETS, registry=r
        ).labels(self.rank)
        self.data_wait = counter("instcls_data_wait_seconds_total", "Time the step waited for the data loader.")
        self.phase_seconds = Counter(
            "instcls_step_phase_seconds", "Time of the training steps by phase (label phase: forward, objective, "
            "backward, optimizer, checkpoint), on the device's clock.", labels + ["phase"], registry=r)
        self.bad_samples = counter("instcls_bad_samples_skipped_total",
                                   "Unreadable samples skipped (data.loader.on_bad_sample: skip).")
        # What reading the shards asked of their store (a directory or s3://), counted where the
        # reads ran (DataLoader workers included) and carried here with each batch.
        self.read_requests = counter("instcls_shard_read_requests_total",
                                     "Sample reads sent to the shard store (pread calls, or ranged GETs on s3://).")
        self.read_bytes = counter("instcls_shard_read_bytes_total", "Bytes read from the shard store.")
        self.read_retries = counter("instcls_shard_read_retries_total",
                                    "Store requests retried after no answer (refused, reset, timed out, 5xx).")
        self.read_errors = counter("instcls_shard_read_errors_total",
                                   "Store requests that failed for good (after their retries).")
        self.shard_opens = counter("instcls_shard_opens_total", "Shard files opened (a local set keeps them open).")
        self.read_seconds = Histogram("instcls_shard_read_seconds", "Latency of one sample read from the shard store.",
                                      labels, buckets=READ_BUCKETS, registry=r).labels(self.rank)
        self.nonfinite_skipped = counter(
            "instcls_nonfinite_steps_skipped_total",
            "Steps dropped because a rank's loss was NaN or inf (optim.on_nonfinite: skip_step).",
        )
        self.loss = gauge("instcls_loss", "Training loss at the last log step.")
        self.lr = gauge("instcls_learning_rate", "Current learning rate.")
        self.memory = gauge(
            "instcls_memory_bytes", "Memory of this rank (CUDA allocated/reserved, or CPU RSS).", ["kind"]
        )
        self.shard_bytes = gauge(
            "instcls_classifier_shard_bytes",
            "Bytes of the parameters this rank's objective trains (e.g. its classifier shard).",
        )
        self.comm = counter("instcls_classifier_comm_seconds_total", "Time in the objective's collectives.")
        self.objective = gauge(
            "instcls_objective_metric", "A metric the training objective reports (label: metric).", ["metric"]
        )
        self.epoch = gauge("instcls_epoch", "Current epoch (0-based).")
        self.epoch_progress = gauge("instcls_epoch_progress_ratio", "Fraction of the current epoch done.")
        self.steps_per_epoch = gauge("instcls_steps_per_epoch", "Steps in one epoch on this rank.")
        self.epochs_planned = gauge("instcls_epochs_planned", "Epochs the job is configured to train (for ETAs).")
        self.world_size = gauge("instcls_world_size", "Ranks of the job since its last (re)start.")
        self.restarts = gauge("instcls_restarts", "Resumes of this job from a checkpoint (0: never restarted).")
        self.steps_lost = gauge("instcls_restart_steps_lost",
                                "Steps trained after the checkpoint the last restart resumed, trained again (rank 0).")
        self.restart_seconds = gauge("instcls_restart_stopped_seconds",
                                     "Seconds from the last step logged before the last restart to its resume "
                                     "(rank 0).")
        self.eval_knn = Gauge(
            "instcls_eval_knn_accuracy",
            "kNN accuracy on the held-out split at the last evaluation (label network: trained or random_init).",
            labels + ["network"],
            registry=r,
        )

        self.eval_failed = gauge("instcls_eval_failed",
                                 "1 when the end-of-run evaluation failed after the final checkpoint was complete "
                                 "(the run still finished: re-score it with `instcls eval`), else 0.")

    def add_phases(self, seconds: dict[str, float]) -> None:
        for phase, value in seconds.items():
            self.phase_seconds.labels(self.rank, phase).inc(value)

    def add_reads(self, reads) -> None:
        """A step's ``StatsSnapshot`` of store reads."""
        self.read_requests.inc(reads.requests)
        self.read_bytes.inc(reads.bytes)
        self.read_retries.inc(reads.retries)
        self.read_errors.inc(reads.errors)
        self.shard_opens.inc(reads.opens)
        for seconds in reads.latencies_s.tolist():
            self.read_seconds.observe(seconds)

    def set_memory(self, readings: dict[str, int]) -> None:
        for kind, value in readings.items():
            self.memory.labels(self.rank, kind).set(value)

    def serve(self, port: int, address: str = "0.0.0.0") -> None:
        """Serve ``/metrics``, or stop with an error naming the port when it is taken.  The port is never
        moved silently: Prometheus scrapes the one in the pod spec, and a moved endpoint is a blank dashboard."""
        try:
            serve_bounded(self.registry, port, address)
        except OSError as error:
            if error.errno != errno.EADDRINUSE:
                raise
            raise MetricsPortInUse(
                f"logging.metrics_port: rank {self.rank} cannot serve metrics on {address}:{port}, the port is in use "
                "(another job on this node, or an earlier run still exiting; local rank r serves metrics_port + r). "
                "Set logging.metrics_port to a free base port, or 0 to turn the endpoint off"
            ) from None


class MetricsPortInUse(ValueError):
    """The metrics port is taken (a ValueError, so the CLI prints it as a one-line error)."""

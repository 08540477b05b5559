"""A taken metrics port is an error that names it (the job-level drill, with the rendezvous port,
is in tests/integration/test_drills.py)."""

import pytest

from trainer.drills.catalogue import taken_port
from trainer.observability.metrics import MetricsPortInUse, TrainingMetrics


def test_a_taken_metrics_port_is_an_error_that_names_it():
    with taken_port() as port, pytest.raises(
            MetricsPortInUse, match=rf"cannot serve metrics on 0\.0\.0\.0:{port}, the port is in use.*"
            r"Set logging\.metrics_port to a free base port, or 0"):
        TrainingMetrics(rank=0).serve(port)

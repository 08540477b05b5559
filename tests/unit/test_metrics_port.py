"""A taken metrics port is an error that names it (the job-level drill, with the rendezvous port,
is in tests/integration/test_drills.py)."""

import socket

import pytest

from trainer.observability.metrics import MetricsPortInUse, TrainingMetrics


@pytest.fixture
def taken_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        yield holder.getsockname()[1]


def test_a_taken_metrics_port_is_an_error_that_names_it(taken_port):
    with pytest.raises(MetricsPortInUse, match=rf"cannot serve metrics on 0\.0\.0\.0:{taken_port}, the port is in use.*"
                       r"Set logging\.metrics_port to a free base port, or 0"):
        TrainingMetrics(rank=0).serve(taken_port)

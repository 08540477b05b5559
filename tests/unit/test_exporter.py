"""The metrics endpoint serves the registry, caches its rendering, and accepts a bounded number of
scrapes per second however many scrapers connect."""

import threading
import time
import urllib.error
import urllib.request

import pytest

from trainer.observability.exporter import serve_bounded
from trainer.observability.metrics import TrainingMetrics
from trainer.parallel.launch import free_port


def _get(url: str, timeout: float = 5.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read()


def test_the_endpoint_serves_the_registry_and_only_it():
    metrics = TrainingMetrics(rank=3)
    metrics.samples.inc(7)
    port = free_port()
    serve_bounded(metrics.registry, port, "127.0.0.1", refresh_s=0.0)
    body = _get(f"http://127.0.0.1:{port}/metrics").decode()
    assert 'instcls_samples_processed_total{rank="3"} 7.0' in body
    metrics.samples.inc(1)
    assert 'instcls_samples_processed_total{rank="3"} 8.0' in _get(f"http://127.0.0.1:{port}/metrics").decode()
    with pytest.raises(urllib.error.HTTPError, match="404"):
        _get(f"http://127.0.0.1:{port}/other")


def test_a_scrape_storm_is_served_at_the_bounded_rate():
    metrics = TrainingMetrics(rank=0)
    port, rate, seconds = free_port(), 10.0, 3.0
    serve_bounded(metrics.registry, port, "127.0.0.1", max_scrapes_per_s=rate)
    served, stop_at = [], time.monotonic() + seconds

    def scrape() -> None:
        while time.monotonic() < stop_at:
            try:
                _get(f"http://127.0.0.1:{port}/metrics", timeout=seconds)
                served.append(time.monotonic())
            except OSError:
                pass

    threads = [threading.Thread(target=scrape) for _ in range(20)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    within = [t for t in served if t <= stop_at]
    # The bound is the point; the floor only shows scrapes get through, loose enough for a loaded
    # machine (a refused connection's retry waits 1 s).
    assert 0.3 * rate * seconds <= len(within) <= rate * seconds + 2, len(within)

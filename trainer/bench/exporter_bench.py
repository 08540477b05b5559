"""`instcls bench exporter`: what many concurrent Prometheus scrapes cost a training step.

One process trains the demo backbone on CPU (forward + backward + SGD on random images, one
thread) and serves its real ``TrainingMetrics`` on the loopback interface, updating them every
step as the trainer does.  Windows of equal length alternate: quiet, then ``scrapers`` threads in
another process fetching ``/metrics`` back to back.  Throughput is compared window by window, so
both variants see the same moments of a shared machine.  The scrapers live in their own process
(as Prometheus lives off the node) so only the exporter's work in the training process counts.
"""

from __future__ import annotations

import multiprocessing
import threading
import time
import urllib.request
from statistics import fmean

import torch

from trainer.bench.settings.exporter import ExporterBenchSettings
from trainer.models import ModelConfig, build_model
from trainer.observability.metrics import TrainingMetrics
from trainer.parallel.launch import free_port

# The exporter is on this machine: never through an http_proxy the environment may name.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _scrape_until(url: str, stop_at: float, served: list[int], errors: list[int], index: int) -> None:
    while time.monotonic() < stop_at:
        try:
            with _DIRECT.open(url, timeout=5) as response:
                response.read()
            served[index] += 1
        except OSError:
            errors[index] += 1


def _scraper_process(url: str, scrapers: int, seconds: float, started, result) -> None:
    served, errors = [0] * scrapers, [0] * scrapers
    stop_at = time.monotonic() + seconds
    threads = [threading.Thread(target=_scrape_until, args=(url, stop_at, served, errors, i)) for i in range(scrapers)]
    for thread in threads:
        thread.start()
    started.set()
    for thread in threads:
        thread.join()
    result.put((sum(served), sum(errors)))


class _Trainer:
    """The demo backbone's step, with the metric updates the real trainer makes per step."""

    def __init__(self, settings: ExporterBenchSettings, metrics: TrainingMetrics) -> None:
        torch.manual_seed(0)
        self.model = build_model(ModelConfig(arch=settings.arch, head_hidden_dim=512, feature_dim=128))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        self.images = torch.randn(settings.batch, 3, settings.image_size, settings.image_size)
        self.metrics, self.batch = metrics, settings.batch

    def steps_for(self, seconds: float) -> float:
        """Steps per second over a window of ``seconds``."""
        done, start = 0, time.perf_counter()
        while (elapsed := time.perf_counter() - start) < seconds:
            step_start = time.perf_counter()
            loss = self.model(self.images).square().mean()
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.metrics.samples.inc(self.batch)
            self.metrics.step_duration.observe(time.perf_counter() - step_start)
            self.metrics.loss.set(loss.item())
            done += 1
        return done / elapsed


def run(settings: ExporterBenchSettings) -> dict:
    torch.set_num_threads(1)
    metrics = TrainingMetrics(rank=0)
    port = free_port()
    metrics.serve(port, "127.0.0.1")
    url = f"http://127.0.0.1:{port}/metrics"
    trainer = _Trainer(settings, metrics)
    trainer.steps_for(min(2.0, settings.seconds))  # warm-up: allocator, first-iteration costs

    context = multiprocessing.get_context("spawn")
    quiet, loaded, scrapes, failed = [], [], 0, 0
    for _ in range(settings.rounds):
        quiet.append(trainer.steps_for(settings.seconds))
        started, result = context.Event(), context.Queue()
        scraper = context.Process(target=_scraper_process, args=(url, settings.scrapers, settings.seconds + 1.0,
                                                                 started, result))
        scraper.start()
        started.wait()
        loaded.append(trainer.steps_for(settings.seconds))
        done, errors = result.get()
        scraper.join()
        scrapes, failed = scrapes + done, failed + errors
    ratios = [lo / q for q, lo in zip(quiet, loaded)]
    return {
        "settings": settings.__dict__,
        "quiet_steps_per_s": quiet,
        "loaded_steps_per_s": loaded,
        "loaded_over_quiet": ratios,
        "overhead_percent": 100.0 * (1.0 - fmean(ratios)),
        "scrapes_per_s": scrapes / (settings.rounds * (settings.seconds + 1.0)),
        "failed_scrapes": failed,
    }


def format_report(summary: dict) -> str:
    s = summary["settings"]
    lines = [f"exporter under load: {s['scrapers']} concurrent scrapers on loopback, {s['rounds']} rounds of "
             f"{s['seconds']:g} s quiet / {s['seconds']:g} s loaded; step = {s['arch']} batch {s['batch']} at "
             f"{s['image_size']} px, 1 thread",
             f"{'round':>5}  {'quiet steps/s':>13}  {'loaded steps/s':>14}  {'loaded/quiet':>12}"]
    for i, (q, lo, r) in enumerate(zip(summary["quiet_steps_per_s"], summary["loaded_steps_per_s"],
                                       summary["loaded_over_quiet"])):
        lines.append(f"{i + 1:>5}  {q:>13.2f}  {lo:>14.2f}  {r:>12.3f}")
    quiet = summary["quiet_steps_per_s"]
    lines.append(f"throughput cost of the scrapes: {summary['overhead_percent']:.2f}% "
                 f"({summary['scrapes_per_s']:.0f} scrapes/s served, {summary['failed_scrapes']} timed out or refused)")
    lines.append(f"noise: the quiet windows alone differ by up to {100 * (max(quiet) / min(quiet) - 1):.1f}% "
                 "among themselves; a cost inside that is not resolved")
    return "\n".join(lines)

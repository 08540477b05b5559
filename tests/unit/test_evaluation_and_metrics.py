"""kNN against scikit-learn's weighted KNeighborsClassifier; linear probe; the metrics exporter."""

import urllib.request

import numpy as np
import torch
from sklearn.neighbors import KNeighborsClassifier

from trainer.evaluation.knn import knn_accuracy, knn_predict
from trainer.evaluation.linear import linear_probe_accuracy
from trainer.observability.metrics import METRIC_NAMES, TrainingMetrics
from trainer.parallel.launch import free_port


def clusters(n_per_class, seed, spread=0.6):
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, 16, generator=torch.Generator().manual_seed(0)) * 2
    labels = torch.arange(4).repeat_interleave(n_per_class)
    return centres[labels] + spread * torch.randn(len(labels), 16, generator=generator), labels


def test_weighted_knn_matches_scikit_learn():
    bank, bank_labels = clusters(30, seed=1, spread=1.5)
    queries, _ = clusters(20, seed=2, spread=1.5)
    temperature = 0.07
    reference = KNeighborsClassifier(
        n_neighbors=20, metric="cosine", algorithm="brute",
        weights=lambda distance: np.exp((1 - distance) / temperature),  # cosine distance = 1 - similarity
    ).fit(bank.numpy(), bank_labels.numpy())
    ours = knn_predict(bank, bank_labels, queries, k=20, temperature=temperature, chunk=7)
    assert ours.tolist() == reference.predict(queries.numpy()).tolist()


def test_accuracies_on_separable_data():
    bank, bank_labels = clusters(30, seed=1)
    queries, query_labels = clusters(20, seed=2)
    assert knn_accuracy(bank, bank_labels, queries, query_labels) > 0.95
    assert linear_probe_accuracy(bank, bank_labels, queries, query_labels) > 0.95
    shuffled = query_labels[torch.randperm(len(query_labels), generator=torch.Generator().manual_seed(3))]
    assert knn_accuracy(bank, bank_labels, queries, shuffled) < 0.5


def test_exporter_serves_every_metric_with_rank_labels():
    metrics = TrainingMetrics(rank=3)
    metrics.samples.inc(64)
    metrics.step_duration.observe(0.2)
    metrics.set_memory({"rss": 1234})
    port = free_port()
    metrics.serve(port)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for name in METRIC_NAMES:
        assert f"\n{name}" in text or text.startswith(name) or f"# TYPE {name}" in text, name
    # and the list is complete: the dashboard test checks its queries against it
    served = {family.name + ("_total" if family.type == "counter" else "") for family in metrics.registry.collect()}
    assert served == set(METRIC_NAMES)
    assert 'instcls_samples_processed_total{rank="3"} 64.0' in text
    assert 'instcls_memory_bytes{kind="rss",rank="3"} 1234.0' in text
    assert 'instcls_step_duration_seconds_bucket{le="0.25",rank="3"} 1.0' in text

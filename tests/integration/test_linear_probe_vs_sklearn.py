"""On the demo's features (its digit scenes through its ResNet-10, in one process), the data-parallel
SGD probe with the shipped sweep lands within 2 points of scikit-learn's logistic regression, the
reference fit, for the random-init networks of two seeds."""

import pytest
import torch

from tests.helpers.training import REPO
from trainer.checkpoint.initial_weights import starting_network
from trainer.config import load_job_config
from trainer.evaluation.features import EvaluationData
from trainer.evaluation.linear import linear_probe_accuracy
from trainer.evaluation.linear_protocol import probe_grid
from trainer.evaluation.linear_sgd import linear_probe
from trainer.parallel.dims import single_process_dims

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # one seed by default
def test_the_sgd_probe_is_within_two_points_of_scikit_learn_on_the_demos_features(scene_shards, seed):
    config = load_job_config(REPO / "configs" / "demo_cpu.yaml", [
        f"data.train_shards={scene_shards['train']}", f"data.eval_shards={scene_shards['val']}", f"seed={seed}",
        "data.loader.backend=torch", "data.loader.num_threads=1"])
    dims = single_process_dims(torch.device("cpu"))
    bank, queries = EvaluationData(config.data, config.eval, dims).bank_and_queries(starting_network(config))
    reference = linear_probe_accuracy(bank.features, bank.labels, queries.features, queries.labels)
    probe = linear_probe(bank, queries, probe_grid(config.eval.linear), None)[1.0]
    assert abs(probe.top1 - reference) <= 0.02, (probe.top1, reference, probe.grid)

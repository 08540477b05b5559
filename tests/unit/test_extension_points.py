"""Each extension point takes a new entry as one registration, here written inside the test: a
data source that `instcls make-shards` then offers with its own flag, a sampler that
``data.loader.sampler.kind`` then selects, and a kernel term the classifier then fuses into its
chunk loop (checked against a float64 full-matrix reference).  The toy objective is in
tests/integration/test_objective_seam.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data_pipeline.ingest.sources import Flag, SourceKind, register_source, unregister_source
from data_pipeline.ingest.sources.generated import synthetic
from data_pipeline.loading.loader_config import LoaderConfig, SamplerConfig
from data_pipeline.loading.samplers import SAMPLERS, register_sampler
from data_pipeline.loading.samplers.base import StepIndices, steps_per_epoch
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.classifier.kernel.reductions import SampleColumns
from trainer.classifier.terms import register_term, unregister_term
from trainer.parallel import single_process_dims


def test_a_registered_source_is_offered_by_make_shards_with_its_flag(tmp_path):
    from trainer.cli import main

    toy = SourceKind("toy-noise", "random images of a chosen side",
                     (Flag("--toy-side", "side in pixels", {"type": int, "default": 8}),),
                     open=lambda args: synthetic(5, args.toy_side, args.seed))
    register_source(toy)
    try:
        assert main(["make-shards", "--source", "toy-noise", "--toy-side", "12", "--out", str(tmp_path / "s"),
                     "--no-progress"]) == 0
    finally:
        unregister_source("toy-noise")
    manifest = json.loads((tmp_path / "s" / "manifest.json").read_text())
    assert manifest["num_instances"] == 5
    with pytest.raises(ValueError, match="a shared flag needs the same options"):
        register_source(SourceKind("clash", "x", (Flag("--root", "a string root", {"type": str}),),
                                   open=lambda args: None))
    with pytest.raises(ValueError, match="exactly one of open"):
        SourceKind("neither", "x")


class ReversedOrder:
    """Stored order, back to front, one global batch per step (a toy sampler)."""

    KIND = "reversed"

    def __init__(self, num_samples: int, world_size: int, batch_size: int) -> None:
        self.num_samples, self.world_size, self.batch_size = num_samples, world_size, batch_size
        self.steps_per_epoch = steps_per_epoch(num_samples, world_size, batch_size, "drop")

    def step(self, epoch: int, step: int) -> StepIndices:
        size = self.world_size * self.batch_size
        ids = np.arange(self.num_samples - 1, -1, -1)[step * size:(step + 1) * size]
        return StepIndices(ids.reshape(self.world_size, self.batch_size), np.ones((self.world_size, self.batch_size),
                                                                                 dtype=bool))

    def state_dict(self) -> dict:
        return {"kind": self.KIND, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        pass


def test_a_registered_sampler_is_selected_by_the_loader_config(tmp_path):
    from data_pipeline.ingest.make_shards import ShardSettings, write_shards
    from data_pipeline.loading.loader import build_loader

    write_shards(synthetic(24, 16), tmp_path, ShardSettings(samples_per_shard=8), progress=False)
    with pytest.raises(ValueError, match="kind='reversed' is invalid"):
        SamplerConfig(kind="reversed")
    register_sampler("reversed", lambda request: ReversedOrder(request.num_samples, request.world_size,
                                                               request.batch_size))
    try:
        config = LoaderConfig(batch_size=4, backend="torch", num_threads=1, sampler=SamplerConfig(kind="reversed"))
        loader = build_loader(tmp_path, config, 1, 2, torch.device("cpu"), train=True)
        assert isinstance(loader.sampler, ReversedOrder) and len(loader) == 3
        first = next(iter(loader.epoch_batches(0)))
        assert first.instance_ids.tolist() == [19, 18, 17, 16]  # rank 1's half of the first global batch
    finally:
        SAMPLERS.pop("reversed")


class LogPartition:
    """A toy term: ln sum_j exp(z_j) of every column over the scored rows (a z-loss's core)."""

    weight = 0.5

    def start_forward(self, kernel_pass):
        return LogPartitionForward()

    def start_backward(self, kernel_pass, saved, grad_term, column_signs, shift_base2):
        return LogPartitionBackward(saved, grad_term, column_signs, shift_base2)


class LogPartitionForward:
    def __init__(self) -> None:
        self.sums = None

    def add_chunk(self, kernel_sum, logits, chunk):
        chunk_sum = torch.exp2(logits).sum(0)
        self.sums = chunk_sum if self.sums is None else self.sums + chunk_sum
        return kernel_sum + chunk_sum

    def columns(self):
        return SampleColumns(sums={"toy_partition": self.sums})

    def finish(self, reduced):
        return torch.log(reduced["toy_partition"]), reduced["toy_partition"]


class LogPartitionBackward:
    def __init__(self, partition, grad_term, column_signs, shift_base2) -> None:
        signs = torch.ones_like(grad_term) if column_signs is None else column_signs
        self.factor = (grad_term * signs / partition)[None, :]  # the kernel multiplies columns by signs after
        self.shift = shift_base2[None, :]

    def grad_logits(self, logits, chunk):
        return torch.exp2(logits - self.shift) + self.factor * torch.exp2(logits)


@pytest.mark.parametrize("chunk_size", [3, 64])
def test_a_registered_term_joins_the_classifier_loss(chunk_size):
    register_term("toy_partition", lambda settings, views: LogPartition())
    try:
        classifier = ShardedCosineClassifier(ClassifierConfig(num_classes=13, feature_dim=6, init_std=1.0,
                                                              chunk_size=chunk_size),
                                             single_process_dims(torch.device("cpu")))
    finally:
        unregister_term("toy_partition")
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(9, 6, generator=generator, requires_grad=True)
    ids = torch.randint(0, 13, (9,), generator=generator)
    valid = torch.ones(9, dtype=torch.bool)
    valid[4] = False
    loss = classifier(features, ids, None, valid=valid, global_valid=8)
    loss.backward()

    x = features.detach().double().requires_grad_()
    w = classifier.weight.detach().double().requires_grad_()
    logits = F.normalize(x, dim=1) @ F.normalize(w, dim=1).t() / 0.15
    per_sample = F.cross_entropy(logits, ids, reduction="none") + 0.5 * torch.logsumexp(logits, dim=1)
    reference = per_sample[valid].mean()
    reference.backward()
    torch.testing.assert_close(loss.double(), reference, atol=1e-5, rtol=0)
    torch.testing.assert_close(features.grad.double(), x.grad, atol=1e-5, rtol=0)
    torch.testing.assert_close(classifier.weight.grad.double(), w.grad, atol=1e-5, rtol=0)

"""Contracts between the engine pieces, on 2 gloo ranks:

* the contrastive prior writes each instance's feature into that instance's row;
* DeepSpeed's averaging of backbone gradients plus the classifier's feature-gradient scale gives
  the exact gradient of the global-batch loss (compared with one process doing it all).
"""

import pytest
import torch
import torch.nn.functional as F

from data_pipeline.loading.augment.augment_config import AugmentConfig
from data_pipeline.loading.loader import build_loader
from data_pipeline.loading.loader_config import LoaderConfig
from tests.helpers.reference import reference_loss
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.engine.deepspeed_setup import initialize_backbone, load_deepspeed_config
from trainer.models import ModelConfig, build_model
from trainer.objectives.instance.objective import contrastive_prior
from trainer.parallel import init_distributed
from trainer.parallel.collectives import gather_rows
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration


def _full_weight(classifier, dims):
    """All rows of a DHP classifier, gathered (shards padded to the largest)."""
    rows = -(-classifier.config.num_classes // dims.world_size)
    padded = torch.zeros(rows, classifier.config.feature_dim)
    padded[: classifier.num_classes_local] = classifier.weight.detach()
    gathered = gather_rows(padded, dims.classifier_group).view(dims.world_size, rows, -1)
    sizes = [classifier.config.num_classes // dims.world_size + (r < classifier.config.num_classes % dims.world_size)
             for r in range(dims.world_size)]
    return torch.cat([gathered[r, : sizes[r]] for r in range(dims.world_size)])


def _prior_matches_direct_pass(shard_dir):
    dims = init_distributed()
    torch.manual_seed(0)
    model = build_model(ModelConfig(arch="resnet18", head_hidden_dim=64, feature_dim=16))
    engine, _ = initialize_backbone(model, load_deepspeed_config("ds_configs/zero0.json", 32), 0.1, 0.9, 0.0)
    num_classes = build_loader(shard_dir, LoaderConfig(batch_size=32), 0, 1, dims.device, train=False).num_instances
    classifier = ShardedCosineClassifier(ClassifierConfig(num_classes=num_classes, feature_dim=16), dims)
    loader_config = LoaderConfig(batch_size=32, num_threads=1, augment=AugmentConfig(image_size=32))
    loader = build_loader(shard_dir, loader_config, dims.rank, dims.world_size, dims.device, train=False)
    engine.train()  # BatchNorm in train mode, as the trainer runs the prior
    assert contrastive_prior(engine, loader.epoch_batches(0), classifier, dims) == classifier.num_classes_local
    full = _full_weight(classifier, dims)
    # Direct pass: the same deterministic batches, BatchNorm in train mode (batch statistics).
    with torch.no_grad():
        for batch in build_loader(shard_dir, loader_config, dims.rank, dims.world_size, dims.device,
                                  train=False).epoch_batches(0):
            expected = F.normalize(engine(batch.views[0]), dim=1)
            valid = batch.valid  # padding repeats are forwarded but never written
            torch.testing.assert_close(full[batch.instance_ids[valid]], expected[valid], atol=1e-5, rtol=0)


def test_contrastive_prior_fills_the_right_rows(color_shards):
    spawn_local_workers(_prior_matches_direct_pass, 2, color_shards)


NUM_CLASSES, IN_DIM, DIM, LOCAL_BATCH, LR = 23, 12, 8, 4, 0.5


def _one_step_matches_single_process(ds_config_path):
    dims = init_distributed()
    torch.manual_seed(0)
    backbone = torch.nn.Linear(IN_DIM, DIM)  # no BatchNorm: the batch split must not matter
    start = {k: v.clone() for k, v in backbone.state_dict().items()}
    engine, _ = initialize_backbone(backbone, load_deepspeed_config(ds_config_path, LOCAL_BATCH), LR, 0.0, 0.0)
    classifier = ShardedCosineClassifier(ClassifierConfig(num_classes=NUM_CLASSES, feature_dim=DIM, init_std=1.0), dims)
    w_start = _full_weight(classifier, dims)
    generator = torch.Generator().manual_seed(1)
    images = torch.randn(LOCAL_BATCH * dims.world_size, IN_DIM, generator=generator)
    ids = torch.randint(0, NUM_CLASSES, (images.shape[0],), generator=generator)
    mine = slice(dims.rank * LOCAL_BATCH, (dims.rank + 1) * LOCAL_BATCH)

    loss = classifier(engine(images[mine]), ids[mine])
    engine.backward(loss)
    engine.step()
    with torch.no_grad():  # the classifier's own SGD step
        classifier.weight -= LR * classifier.weight.grad

    # One process, whole batch, plain autograd: the gradient of the global-batch mean loss.
    reference = torch.nn.Linear(IN_DIM, DIM)
    reference.load_state_dict(start)
    weight = w_start.clone().requires_grad_()
    reference_loss(reference(images), weight, ids, None, 0.0, 0.15, "paper").backward()
    with torch.no_grad():
        for p in reference.parameters():
            p -= LR * p.grad
    with deepspeed_gathered(engine):
        for name, p in engine.module.named_parameters():
            torch.testing.assert_close(p.detach().float(), dict(reference.named_parameters())[name].detach(),
                                       atol=1e-6, rtol=1e-5, msg=f"backbone {name} on rank {dims.rank}")
    torch.testing.assert_close(
        _full_weight(classifier, dims), (w_start - LR * weight.grad).float(), atol=1e-6, rtol=1e-5
    )


def deepspeed_gathered(engine):
    from trainer.parallel.deepspeed_import import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 2])
def test_deepspeed_gradient_average_gives_the_global_batch_gradient(stage):
    spawn_local_workers(_one_step_matches_single_process, 2, f"ds_configs/zero{stage}.json")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_deepspeed_gradient_average_other_zero_stages(stage):
    spawn_local_workers(_one_step_matches_single_process, 2, f"ds_configs/zero{stage}.json")

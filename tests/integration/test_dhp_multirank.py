"""DHP and DDP (replicated) classifiers on 2-4 gloo ranks against the single-process float64 reference.

Every rank builds the same global batch and full weight from a seed, keeps its own part, and
checks its results against the reference; a failing rank raises and the test fails with its
traceback.
"""

import itertools

import pytest
import torch

from tests.helpers.reference import random_hard_negatives, reference_grads, reference_loss
from trainer.classifier import ClassifierConfig, ClassifierInputError, ShardedCosineClassifier, gaussian_rows
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

NUM_CLASSES, DIM, LOCAL_BATCH, TOP_K, TAU = 37, 8, 8, 4, 0.15


def global_batch(world_size, seed=11):
    generator = torch.Generator().manual_seed(seed)
    batch = LOCAL_BATCH * world_size
    features = torch.randn(batch, DIM, generator=generator)
    ids = torch.randint(0, NUM_CLASSES, (batch,), generator=generator)
    hard = random_hard_negatives(ids, NUM_CLASSES, TOP_K, generator)
    return features, ids, hard


def _check_against_reference(classifier_parallel_size):
    dims = init_distributed(classifier_parallel_size)
    world, rank = dims.world_size, dims.rank
    features_all, ids_all, hard_all = global_batch(world)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    group_size = dims.classifier_parallel_size
    group_start = (rank // group_size) * group_size * LOCAL_BATCH
    group_rows = slice(group_start, group_start + group_size * LOCAL_BATCH)
    full_weight = gaussian_rows(0, NUM_CLASSES, DIM, std=1.0, seed=0)

    cases = itertools.product(["dhp", "ddp"], ["paper", "soft_target"], [0.0, 0.2], [5, 64], [True, False])
    for mode, form, alpha, chunk, averaged in cases:
        config = ClassifierConfig(
            num_classes=NUM_CLASSES, feature_dim=DIM, temperature=TAU, chunk_size=chunk, mode=mode,
            smoothing_alpha=alpha, top_k=TOP_K, smoothing_form=form, init_std=1.0,
            backbone_grads_averaged=averaged,
        )
        classifier = ShardedCosineClassifier(config, dims)
        if mode == "dhp":  # every rank's batch must reach every shard: the hard case for the exchange
            coverage = classifier.shard.owner_of(ids_all[mine]).unique().numel()
            assert coverage == group_size, f"rank {rank} batch does not reach every shard"
        features = features_all[mine].clone().requires_grad_()
        loss = classifier(features, ids_all[mine], hard_all[mine])
        loss.backward()
        classifier.reduce_weight_grad()

        label = f"rank {rank} {mode} {form} alpha={alpha} chunk={chunk} averaged={averaged}"
        loss_rows = group_rows if mode == "dhp" else mine
        expected_loss = reference_loss(
            features_all[loss_rows], full_weight, ids_all[loss_rows], hard_all[loss_rows], alpha, TAU, form
        )
        _, grad_x, grad_w = reference_grads(features_all, full_weight, ids_all, hard_all, alpha, TAU, form)
        # Backbone gradients are averaged over all ranks afterwards (or, with averaged=False in
        # DHP, summed over one classifier group's loss); see ClassifierConfig.backbone_grads_averaged.
        feature_scale = world if mode == "ddp" or averaged else dims.num_classifier_replicas
        rows = slice(classifier.class_start, classifier.class_start + classifier.num_classes_local)
        torch.testing.assert_close(loss.double(), expected_loss, atol=1e-5, rtol=0, msg=f"loss, {label}")
        torch.testing.assert_close(
            features.grad.double(), grad_x[mine] * feature_scale, atol=1e-5, rtol=0, msg=f"feature grad, {label}"
        )
        torch.testing.assert_close(
            classifier.weight.grad.double(), grad_w[rows], atol=1e-5, rtol=0, msg=f"weight grad, {label}"
        )


@pytest.mark.parametrize("world_size", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_matches_reference_on_uneven_shards(world_size):
    spawn_local_workers(_check_against_reference, world_size, None)


@pytest.mark.slow
def test_matches_reference_with_two_classifier_groups():
    """4 ranks, classifier sharded 2 ways: two replicas whose shard gradients are averaged."""
    spawn_local_workers(_check_against_reference, 4, 2)


def _train_a_few_steps(mode, steps=3):
    """Linear 'backbone' (DDP-style averaged grads) + classifier, SGD with momentum and weight decay."""
    dims = init_distributed()
    torch.manual_seed(0)
    backbone = torch.nn.Linear(16, DIM)
    config = ClassifierConfig(
        num_classes=NUM_CLASSES, feature_dim=DIM, chunk_size=7, mode=mode, smoothing_alpha=0.2, top_k=TOP_K
    )
    classifier = ShardedCosineClassifier(config, dims)
    parameters = list(backbone.parameters()) + [classifier.weight]
    optimizer = torch.optim.SGD(parameters, lr=0.5, momentum=0.9, weight_decay=1e-4)
    generator = torch.Generator().manual_seed(5)
    for _ in range(steps):
        images = torch.randn(LOCAL_BATCH * dims.world_size, 16, generator=generator)
        ids = torch.randperm(NUM_CLASSES, generator=generator)[: images.shape[0]]
        hard = random_hard_negatives(ids, NUM_CLASSES, TOP_K, generator)
        mine = slice(dims.rank * LOCAL_BATCH, (dims.rank + 1) * LOCAL_BATCH)
        optimizer.zero_grad()
        classifier(backbone(images[mine]), ids[mine], hard[mine]).backward()
        for p in backbone.parameters():  # what DDP / DeepSpeed do with backbone gradients
            torch.distributed.all_reduce(p.grad)
            p.grad.div_(dims.world_size)
        classifier.reduce_weight_grad()
        optimizer.step()
    return backbone, classifier


def _dhp_and_ddp_agree():
    dhp_backbone, dhp = _train_a_few_steps("dhp")
    rep_backbone, replicated = _train_a_few_steps("ddp")
    rows = slice(dhp.class_start, dhp.class_start + dhp.num_classes_local)
    initial = gaussian_rows(0, NUM_CLASSES, DIM, std=0.01, seed=0)
    assert not torch.allclose(replicated.weight.detach(), initial, atol=1e-3), "training did not move W"
    torch.testing.assert_close(dhp.weight.detach(), replicated.weight.detach()[rows], atol=1e-5, rtol=1e-5)
    for a, b in zip(dhp_backbone.parameters(), rep_backbone.parameters()):
        torch.testing.assert_close(a.detach(), b.detach(), atol=1e-5, rtol=1e-5)


def test_dhp_and_ddp_train_to_the_same_parameters():
    spawn_local_workers(_dhp_and_ddp_agree, 2)


def _bad_ids_on_one_rank():
    dims = init_distributed()
    classifier = ShardedCosineClassifier(ClassifierConfig(num_classes=NUM_CLASSES, feature_dim=DIM), dims)
    ids = torch.arange(LOCAL_BATCH) + (NUM_CLASSES if dims.rank == 1 else 0)
    expected = "instance_ids contains 37" if dims.rank == 1 else r"invalid classifier input on rank\(s\) \[1\]"
    with pytest.raises(ClassifierInputError, match=expected):
        classifier(torch.randn(LOCAL_BATCH, DIM), ids)


def _uneven_batches():
    dims = init_distributed()
    classifier = ShardedCosineClassifier(ClassifierConfig(num_classes=NUM_CLASSES, feature_dim=DIM), dims)
    batch = LOCAL_BATCH + dims.rank
    with pytest.raises(ClassifierInputError, match=r"local batch sizes differ across ranks \(8 to 9\)"):
        classifier(torch.randn(batch, DIM), torch.arange(batch))


@pytest.mark.parametrize("worker", [_bad_ids_on_one_rank, _uneven_batches])
def test_bad_input_on_one_rank_fails_every_rank_without_hanging(worker):
    spawn_local_workers(worker, 2)


def _in_backward_sgd_matches_torch_sgd():
    dims = init_distributed()
    config = ClassifierConfig(num_classes=NUM_CLASSES, feature_dim=DIM, chunk_size=5, smoothing_alpha=0.2,
                              top_k=TOP_K)
    plain, fused = ShardedCosineClassifier(config, dims), ShardedCosineClassifier(config, dims)
    sgd = torch.optim.SGD([plain.weight], lr=0.3, momentum=0.9, weight_decay=1e-2)
    in_backward = fused.use_in_backward_sgd(lr=0.3, momentum=0.9, weight_decay=1e-2)
    generator = torch.Generator().manual_seed(9)
    for _ in range(3):
        features = torch.randn(LOCAL_BATCH * dims.world_size, DIM, generator=generator)
        ids = torch.randint(0, NUM_CLASSES, (features.shape[0],), generator=generator)
        hard = random_hard_negatives(ids, NUM_CLASSES, TOP_K, generator)
        mine = slice(dims.rank * LOCAL_BATCH, (dims.rank + 1) * LOCAL_BATCH)
        sgd.zero_grad()
        plain(features[mine], ids[mine], hard[mine]).backward()
        sgd.step()
        fused(features[mine], ids[mine], hard[mine]).backward()
        assert fused.weight.grad is None, "the in-backward update must not materialise W's gradient"
        in_backward.step()
    torch.testing.assert_close(fused.weight.detach(), plain.weight.detach(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(in_backward.state[fused.weight]["momentum_buffer"],
                               sgd.state[plain.weight]["momentum_buffer"], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("world_size", [pytest.param(1, marks=pytest.mark.slow), 2])
def test_sgd_inside_the_backward_equals_torch_sgd(world_size):
    spawn_local_workers(_in_backward_sgd_matches_torch_sgd, world_size)

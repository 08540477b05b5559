"""Padding repeats (the last batch of an epoch) change nothing: a padded batch gives the same loss,
gradients, weights and momentum as the unpadded samples alone, against the float64 reference.

Rank 1 pads its batch with repeats of its own samples (``valid`` False), so the global batch has
fewer valid samples than rows; the reference is the mean over the valid samples only.
"""

import itertools

import pytest
import torch

from tests.helpers.reference import reference_grads
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier, gaussian_rows
from trainer.parallel import init_distributed
from trainer.parallel.launch import spawn_local_workers

pytestmark = pytest.mark.integration

NUM_CLASSES, DIM, LOCAL_BATCH, TAU, LR, MOMENTUM, WD = 23, 6, 5, 0.15, 0.5, 0.9, 1e-2
PADDING = 2  # the last PADDING samples of rank 1 repeat its first ones


def _batch(world_size):
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(world_size * LOCAL_BATCH, DIM, generator=generator)
    ids = torch.randperm(NUM_CLASSES, generator=generator)[: world_size * LOCAL_BATCH]
    valid = torch.ones(world_size * LOCAL_BATCH, dtype=torch.bool)
    last = 2 * LOCAL_BATCH  # rank 1's padded tail
    features[last - PADDING : last] = features[LOCAL_BATCH : LOCAL_BATCH + PADDING]
    ids[last - PADDING : last] = ids[LOCAL_BATCH : LOCAL_BATCH + PADDING]
    valid[last - PADDING : last] = False
    return features, ids, valid


def _sgd(weight, grad, momentum):
    """torch.optim.SGD's update in float64: u <- m u + g + wd w;  w <- w - lr u."""
    momentum = MOMENTUM * momentum + grad + WD * weight
    return weight - LR * momentum, momentum


def _check(classifier_parallel_size):
    dims = init_distributed(classifier_parallel_size)
    world, rank = dims.world_size, dims.rank
    features_all, ids_all, valid_all = _batch(world)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    full_weight = gaussian_rows(0, NUM_CLASSES, DIM, std=1.0, seed=0)
    # The reference never sees the padding: the mean over the valid samples only.
    _, grad_x, grad_w = reference_grads(
        features_all[valid_all], full_weight, ids_all[valid_all], None, 0.0, TAU, "paper"
    )
    expected_grad_x = torch.zeros(features_all.shape, dtype=torch.float64)
    expected_grad_x[valid_all] = grad_x
    modes = ["dhp", "ddp"] if classifier_parallel_size is None else ["dhp"]
    for mode, chunk, in_backward in itertools.product(modes, [4, 64], [False, True]):
        if in_backward and (mode != "dhp" or dims.classifier_parallel_size != world):
            continue
        label = f"rank {rank} {mode} chunk={chunk} in_backward={in_backward}"
        classifier = ShardedCosineClassifier(
            ClassifierConfig(
                num_classes=NUM_CLASSES, feature_dim=DIM, temperature=TAU, chunk_size=chunk, mode=mode, init_std=1.0
            ),
            dims,
        )
        if in_backward:
            optimizer = classifier.use_in_backward_sgd(LR, MOMENTUM, WD)
        else:
            optimizer = torch.optim.SGD([classifier.weight], lr=LR, momentum=MOMENTUM, weight_decay=WD)
        features = features_all[mine].clone().requires_grad_()
        loss = classifier(features, ids_all[mine], valid=valid_all[mine], global_valid=int(valid_all.sum()))
        loss.backward()
        classifier.reduce_weight_grad()
        optimizer.step()

        rows = slice(classifier.class_start, classifier.class_start + classifier.num_classes_local)
        # Backbone gradients are averaged over all ranks afterwards, hence the factor world.
        torch.testing.assert_close(
            features.grad.double(), expected_grad_x[mine] * world, atol=1e-6, rtol=0, msg=f"feature grad, {label}"
        )
        assert torch.all(features.grad[~valid_all[mine]] == 0), f"padding got a gradient, {label}"
        weight, momentum = _sgd(full_weight.double(), grad_w, torch.zeros_like(grad_w))
        torch.testing.assert_close(
            classifier.weight.detach().double(),
            weight[rows],
            atol=1e-6,
            rtol=0,
            msg=f"weight after the update, {label}",
        )
        buffer = optimizer.state[classifier.weight]["momentum_buffer"]
        torch.testing.assert_close(buffer.double(), momentum[rows], atol=1e-6, rtol=0, msg=f"momentum, {label}")


def test_padded_batch_gives_the_unpadded_update_on_2_ranks():
    spawn_local_workers(_check, 2, None)


@pytest.mark.slow
def test_padded_batch_with_two_classifier_groups():
    """4 ranks, 2 groups of 2: the groups hold different numbers of valid samples."""
    spawn_local_workers(_check, 4, 2)

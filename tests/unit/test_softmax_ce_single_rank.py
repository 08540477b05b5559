"""T = 1: the chunked loss against the float64 reference and against F.cross_entropy."""

import pytest
import torch
import torch.nn.functional as F

from tests.helpers.reference import random_hard_negatives, reference_grads
from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
from trainer.parallel import single_process_dims

NUM_CLASSES, DIM, BATCH, TOP_K = 37, 8, 11, 5


def make_classifier(**overrides):
    settings = dict(num_classes=NUM_CLASSES, feature_dim=DIM, init_std=1.0, top_k=TOP_K)
    settings.update(overrides)
    return ShardedCosineClassifier(ClassifierConfig(**settings), single_process_dims(torch.device("cpu")))


@pytest.mark.parametrize("form", ["paper", "soft_target"])
@pytest.mark.parametrize("alpha", [0.0, 0.2])
@pytest.mark.parametrize("chunk_size", [1, 6, 64])
def test_loss_and_grads_match_reference(form, alpha, chunk_size):
    generator = torch.Generator().manual_seed(7)
    classifier = make_classifier(chunk_size=chunk_size, smoothing_alpha=alpha, smoothing_form=form)
    features = torch.randn(BATCH, DIM, generator=generator, requires_grad=True)
    ids = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)
    hard = random_hard_negatives(ids, NUM_CLASSES, TOP_K, generator)

    loss = classifier(features, ids, hard)
    loss.backward()
    ref_loss, ref_grad_x, ref_grad_w = reference_grads(features, classifier.weight, ids, hard, alpha, 0.15, form)

    torch.testing.assert_close(loss.double(), ref_loss, atol=1e-5, rtol=0)
    torch.testing.assert_close(features.grad.double(), ref_grad_x, atol=1e-5, rtol=0)
    torch.testing.assert_close(classifier.weight.grad.double(), ref_grad_w, atol=1e-5, rtol=0)


def test_without_smoothing_it_is_cross_entropy_of_cosine_logits():
    generator = torch.Generator().manual_seed(1)
    classifier = make_classifier(chunk_size=5, temperature=0.2)
    features = torch.randn(BATCH, DIM, generator=generator)
    ids = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)
    logits = F.normalize(features, dim=1) @ F.normalize(classifier.weight.detach(), dim=1).t() / 0.2
    torch.testing.assert_close(classifier(features, ids), F.cross_entropy(logits, ids), atol=1e-6, rtol=0)


def test_the_two_smoothing_forms_differ():
    """Eq. 3 (inside the log) is not the usual soft-target loss; a mix-up between them must show."""
    generator = torch.Generator().manual_seed(2)
    features = torch.randn(BATCH, DIM, generator=generator)
    ids = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)
    hard = random_hard_negatives(ids, NUM_CLASSES, TOP_K, generator)
    paper = make_classifier(smoothing_alpha=0.2, smoothing_form="paper")(features, ids, hard)
    soft = make_classifier(smoothing_alpha=0.2, smoothing_form="soft_target")(features, ids, hard)
    assert abs(paper.item() - soft.item()) > 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_features_accumulate_in_fp32(dtype):
    generator = torch.Generator().manual_seed(3)
    classifier = make_classifier(chunk_size=8, smoothing_alpha=0.2)
    features = torch.randn(BATCH, DIM, generator=generator).to(dtype).requires_grad_()
    ids = torch.randint(0, NUM_CLASSES, (BATCH,), generator=generator)
    hard = random_hard_negatives(ids, NUM_CLASSES, TOP_K, generator)

    loss = classifier(features, ids, hard)
    loss.backward()
    ref_loss, ref_grad_x, ref_grad_w = reference_grads(features, classifier.weight, ids, hard, 0.2, 0.15, "paper")

    assert loss.dtype == torch.float32
    assert features.grad.dtype == dtype and classifier.weight.grad.dtype == torch.float32
    # The matmuls run in half precision: agreement to its ~3 significant digits.
    torch.testing.assert_close(loss.double(), ref_loss, atol=2e-2, rtol=0)
    torch.testing.assert_close(features.grad.double(), ref_grad_x, atol=2e-2, rtol=5e-2)
    torch.testing.assert_close(classifier.weight.grad.double(), ref_grad_w, atol=2e-2, rtol=5e-2)


def test_peak_logits_memory_is_bounded_by_the_chunk():
    """No tensor wider than the chunk is built: watch every tensor saved or allocated by autograd."""
    num_classes, chunk = 4096, 256
    classifier = make_classifier(num_classes=num_classes, chunk_size=chunk)
    features = torch.randn(BATCH, DIM, requires_grad=True)
    ids = torch.randint(0, num_classes, (BATCH,))
    widest = 0

    class WidthWatcher(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            nonlocal widest
            out = func(*args, **(kwargs or {}))
            if isinstance(out, torch.Tensor) and out.dim() == 2 and BATCH in out.shape:  # [B, rows] or [rows, B]
                widest = max(widest, out.shape[1] if out.shape[0] == BATCH else out.shape[0])
            return out

    with WidthWatcher():
        classifier(features, ids).backward()
    assert widest == chunk

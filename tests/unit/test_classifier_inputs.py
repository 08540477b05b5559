"""Bad input gets an error that names the field and the fix."""

import pytest
import torch

from trainer.classifier import ClassifierConfig, ClassifierInputError, ShardedCosineClassifier
from trainer.parallel import init_distributed, single_process_dims


def classifier(**overrides):
    settings = dict(num_classes=20, feature_dim=8, smoothing_alpha=0.2, top_k=3)
    settings.update(overrides)
    return ShardedCosineClassifier(ClassifierConfig(**settings), single_process_dims(torch.device("cpu")))


GOOD_IDS = torch.tensor([0, 5, 19])
GOOD_HARD = torch.tensor([[1, 2, 3], [0, 1, 2], [0, 1, 2]])


@pytest.mark.parametrize(
    "features,ids,hard,message",
    [
        (torch.randn(3, 7), GOOD_IDS, GOOD_HARD, r"features has shape \(3, 7\).*feature_dim"),
        (torch.randn(3, 8).double(), GOOD_IDS, GOOD_HARD, "dtype torch.float64"),
        (torch.randn(3, 8), torch.tensor([0, 5, 20]), GOOD_HARD, r"instance_ids contains 20, outside \[0, 20\)"),
        (torch.randn(3, 8), torch.tensor([0, -1, 2]), GOOD_HARD, "instance_ids contains -1"),
        (torch.randn(3, 8), torch.tensor([0.0, 1.0, 2.0]), GOOD_HARD, "instance_ids has shape"),
        (
            torch.randn(3, 8),
            GOOD_IDS,
            torch.tensor([[1, 2, 21], [0, 1, 2], [0, 1, 2]]),
            "hard_negative_ids contains 21",
        ),
        (torch.randn(3, 8), GOOD_IDS, torch.tensor([[1, 2, 0], [0, 1, 2], [0, 1, 2]]), "own instance id"),
        (torch.randn(3, 8), GOOD_IDS, torch.zeros(2, 3, dtype=torch.long), r"expected integer ids of shape \(3, K\)"),
    ],
)
def test_bad_batches_are_named(features, ids, hard, message):
    with pytest.raises(ClassifierInputError, match=message):
        classifier()(features, ids, hard)


def test_more_hard_negatives_than_other_classes():
    small = classifier(num_classes=4, top_k=3)
    ids = torch.tensor([0, 1])
    with pytest.raises(ClassifierInputError, match=r"K=4 columns but an instance has only 3 other classes"):
        small(torch.randn(2, 8), ids, torch.tensor([[1, 2, 3, 1], [0, 2, 3, 0]]))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(top_k=20), r"top_k=20 is invalid: K must be at most num_classes - 1 = 19"),
        (dict(temperature=0.0), "temperature=0.0 is invalid"),
        (dict(mode="replicated"), r"mode='replicated' is invalid: choose one of \('dhp', 'ddp'\)"),
        (dict(smoothing_form="inside"), "smoothing_form='inside' is invalid"),
        (dict(smoothing_alpha=1.0), "smoothing_alpha=1.0 is invalid"),
        (dict(chunk_size=0), "chunk_size=0 is invalid"),
    ],
)
def test_bad_config_is_named(overrides, message):
    with pytest.raises(ValueError, match=message):
        classifier(**overrides)


def test_validation_can_be_turned_off(monkeypatch):
    import trainer.classifier.sharded_classifier as module

    checked = []
    real_check = module.local_input_problem
    monkeypatch.setattr(module, "local_input_problem", lambda *args: checked.append(args) or real_check(*args))
    features, ids = torch.randn(3, 8), torch.tensor([0, 5, 19])
    classifier(validate_inputs=False, smoothing_alpha=0.0)(features, ids)
    assert checked == [], "validate_inputs=False still ran the input check"
    classifier(validate_inputs=True, smoothing_alpha=0.0)(features, ids)
    assert len(checked) == 1
    with pytest.raises(ClassifierInputError, match=r"instance_ids contains 20, outside \[0, 20\)"):
        classifier(validate_inputs=True, smoothing_alpha=0.0)(features, torch.tensor([0, 5, 20]))


def test_single_process_layout_without_torchrun(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dims = init_distributed()
    assert (dims.world_size, dims.rank, dims.classifier_parallel_size) == (1, 0, 1)
    assert dims.classifier_group is None and dims.data_parallel_group is None


def test_partial_torchrun_environment_is_explained(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(RuntimeError, match="launch with `torchrun`"):
        init_distributed()


@pytest.mark.parametrize("bad_id", [20, -1, 1000])
def test_out_of_range_ids_poison_the_loss_even_with_validation_off(bad_id):
    """The kernel's bounds check stays on: the loss turns NaN (the non-finite watch stops the run)
    instead of silently losing the target term, and the bad sample sends no gradient anywhere."""
    torch.manual_seed(0)
    model = classifier(validate_inputs=False, smoothing_alpha=0.0)
    features = torch.randn(3, 8, requires_grad=True)
    loss = model(features, torch.tensor([0, bad_id, 19]))
    assert torch.isnan(loss)
    loss.backward()
    weight_grad, feature_grad = model.weight.grad.clone(), features.grad.clone()
    assert torch.isfinite(weight_grad).all() and torch.isfinite(feature_grad).all()
    assert torch.equal(feature_grad[1], torch.zeros(8))

    # Reference: the two good samples alone, with the same denominator (3 valid samples).
    model.weight.grad = None
    good = features.detach()[[0, 2]].requires_grad_(True)
    (model(good, torch.tensor([0, 19])) * 2 / 3).backward()
    torch.testing.assert_close(feature_grad[[0, 2]], good.grad)
    torch.testing.assert_close(weight_grad, model.weight.grad)


def test_in_range_ids_with_validation_off_give_a_finite_loss():
    model = classifier(validate_inputs=False, smoothing_alpha=0.0)
    assert torch.isfinite(model(torch.randn(3, 8), torch.tensor([0, 19, 7])))


def test_a_non_finite_padding_column_still_shows_in_the_loss():
    """Padding adds nothing, but a NaN there is a fault (every column scores its own row): the
    trainer's non-finite watch must see it rather than train on its NaN gradients."""
    model = classifier(smoothing_alpha=0.0)
    features = torch.randn(4, 8)
    ids, valid = torch.tensor([0, 1, 2, 3]), torch.tensor([True, True, True, False])
    assert torch.isfinite(model(features, ids, valid=valid))
    features[3] = float("nan")
    assert torch.isnan(model(features, ids, valid=valid))

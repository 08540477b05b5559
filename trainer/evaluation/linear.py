"""Linear probe: multinomial logistic regression (scikit-learn) on frozen, standardised features."""

from __future__ import annotations

import torch


def linear_probe_accuracy(train_features: torch.Tensor, train_labels: torch.Tensor, test_features: torch.Tensor,
                          test_labels: torch.Tensor, regularization: float = 1.0) -> float:
    # scikit-learn takes about 1.4 s to import: every rank of every job would pay it at start-up, for
    # a probe that only rank 0 fits, once, at the end
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    probe = make_pipeline(StandardScaler(), LogisticRegression(C=regularization, max_iter=2000))
    probe.fit(train_features.numpy(), train_labels.numpy())
    return float(probe.score(test_features.numpy(), test_labels.numpy()))


LABEL_FRACTIONS = (0.1, 0.25, 0.5, 1.0)


def linear_probe_curve(train_features: torch.Tensor, train_labels: torch.Tensor, test_features: torch.Tensor,
                       test_labels: torch.Tensor, fractions=LABEL_FRACTIONS, seed: int = 0) -> dict[float, float]:
    """The probe's learning curve: held-out accuracy when it is fitted on a stratified fraction of
    the labelled bank (how much a few labels buy, the usual semi-supervised reading)."""
    from sklearn.model_selection import train_test_split

    curve = {}
    for fraction in fractions:
        features, labels = train_features, train_labels
        if fraction < 1.0:
            features, _, labels, _ = train_test_split(features.numpy(), labels.numpy(), train_size=fraction,
                                                      stratify=labels.numpy(), random_state=seed)
            features, labels = torch.from_numpy(features), torch.from_numpy(labels)
        curve[fraction] = linear_probe_accuracy(features, labels, test_features, test_labels)
    return curve

"""Linear probe: multinomial logistic regression (scikit-learn) on frozen, standardised features."""

from __future__ import annotations

import torch
from sklearn.linear_model import LogisticRegression
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


def linear_probe_accuracy(train_features: torch.Tensor, train_labels: torch.Tensor, test_features: torch.Tensor,
                          test_labels: torch.Tensor, regularization: float = 1.0) -> float:
    probe = make_pipeline(StandardScaler(), LogisticRegression(C=regularization, max_iter=2000))
    probe.fit(train_features.numpy(), train_labels.numpy())
    return float(probe.score(test_features.numpy(), test_labels.numpy()))

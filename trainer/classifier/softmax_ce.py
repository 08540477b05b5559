"""Transitional alias: the loss now lives in ``trainer.classifier.kernel`` (see ``sharded_cosine_ce``).

Kept only so callers of the old positional ``ShardedCosineSoftmaxCE.apply`` keep working while they
move to ``sharded_cosine_ce``; delete this module once nothing imports it.
"""

from __future__ import annotations

from trainer.classifier.kernel import KernelSettings, sharded_cosine_ce
from trainer.classifier.losses import SmoothingForm

__all__ = ["ShardedCosineSoftmaxCE", "SmoothingForm"]


class ShardedCosineSoftmaxCE:
    @staticmethod
    def apply(features, weight, target_cols, target_weights, temperature, chunk_size, form, group, timer=None,
              update_in_backward=None):
        settings = KernelSettings(temperature=temperature, chunk_size=chunk_size, form=SmoothingForm(form).value)
        return sharded_cosine_ce(features, weight, target_cols, target_weights, settings, group, timer,
                                 update_in_backward=update_in_backward)

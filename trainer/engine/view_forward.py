"""The forward half of a step: every view of the batch through the engine in one top-level call.

Views of one size share a batch (``ViewLayout.forward_groups``: one group for two global views,
two for multi-crop's global and local crops); the groups go to the network as a list and come
back as one list of features (``InstanceModel.forward``), so DeepSpeed sees one forward per step
whatever the crop sizes.  Under ZeRO-3 that is what lets its parameter trace complete and its
prefetching start: the trace restarts at every top-level forward.
"""

from __future__ import annotations

import torch

from trainer.engine.gradient_watch import PoisonGradient
from trainer.failpoints import armed
from trainer.models.backbone import ModelConfig, model_input
from trainer.objectives import View


def forward_views(engine, views: list[torch.Tensor], layout, dtype: torch.dtype, model: ModelConfig,
                  step: int) -> list[View]:
    """Head features of every view of ``views`` (the loader's, in view order), as the objective takes
    them; ``layout``: the loader's ``ViewLayout``; ``step``: the step being made (1-based), for the
    fault drills' failpoints."""
    groups = layout.forward_groups()
    batches = [model_input(torch.cat([views[i] for i in indices]), dtype, model) for indices in groups]
    outputs = engine(batches)
    features: list[torch.Tensor | None] = [None] * layout.num_views
    for indices, output in zip(groups, outputs):
        if armed("train.nan_features", step):  # the drills' bad batch
            output = output * float("nan")
        if armed("train.inf_gradient", step):  # a finite loss, an infinite gradient
            output = PoisonGradient.apply(output)
        for index, view_features in zip(indices, output.chunk(len(indices))):
            features[index] = view_features
    return [View(features=f, kind=kind, index=i) for i, (f, kind) in enumerate(zip(features, layout.kinds))]

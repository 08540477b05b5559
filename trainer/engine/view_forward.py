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
                  step: int, wanted: tuple[int, ...] | None = None) -> list[View]:
    """Head features of the views of ``views`` (the loader's, in view order) that ``wanted`` names (None:
    every one), in ``wanted``'s order, as the objective takes them; ``layout``: the loader's
    ``ViewLayout``; ``step``: the step being made (1-based), for the fault drills' failpoints."""
    chosen = tuple(range(layout.num_views)) if wanted is None else wanted
    groups = [[i for i in group if i in chosen] for group in layout.forward_groups()]
    groups = [group for group in groups if group]
    batches = [model_input(torch.cat([views[i] for i in indices]), dtype, model) for indices in groups]
    outputs = engine(batches)
    features: dict[int, torch.Tensor] = {}
    for indices, output in zip(groups, outputs):
        if armed("train.nan_features", step):  # the drills' bad batch
            output = output * float("nan")
        if armed("train.inf_gradient", step):  # a finite loss, an infinite gradient
            output = PoisonGradient.apply(output)
        for index, view_features in zip(indices, output.chunk(len(indices))):
            features[index] = view_features
    return [View(features=features[i], kind=layout.kinds[i], index=i) for i in chosen]

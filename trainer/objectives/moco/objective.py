"""``moco``: MoCo v2 (He et al., CVPR 2020; Chen et al., arXiv 2003.04297) with CO2's consistency term
(Wei et al., ICLR 2021) on its queue.

The query encoder is the student (the network the engine trains) on the first global view; the key
encoder is the trainer's momentum teacher (``TeacherRequest``: momentum 0.999, constant) on the second,
its BatchNorm over the data-parallel group's whole batch (``trainer.parallel.sync_batch_norm``) so that a
key does not depend on how the batch is split.  MoCo's shuffled BN is not implemented: synchronised
statistics remove the leak it guards against (a key normalised with its own query's batch) without a
shuffle across ranks.

Per query, InfoNCE at temperature 0.2 against its key and the K queued keys (``queue_loss``): the queue
is split over the classifier group like the instance classifier's rows, scored a chunk at a time by the
same sharded kernel with the positive as a per-sample logit, and never trained.  After each optimizer
step that was taken, the step's global batch of keys (every rank's, from the loss's own all-gather)
enters the queue (``key_queue``).

CO2 (``co2_alpha`` > 0; its paper's MoCo v2 setting: alpha 0.3, tau_con 0.05) adds the symmetric KL
between the query's and its key's similarity distributions over the queue, in the same kernel pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from data_pipeline.contract import ViewLayout, to_device
from trainer.classifier.classifier_config import HeadSettings
from trainer.objectives.base import LossOut, Objective, ObjectiveConfig, ObjectiveContext, StepViews
from trainer.objectives.memory_plan import QueuedKeys
from trainer.objectives.moco.key_queue import DEFAULT_QUEUE_SIZE, KeyQueue
from trainer.objectives.moco.queue_loss import MOCO_TEMPERATURE, queue_infonce
from trainer.objectives.teacher_request import TeacherRequest
from trainer.parallel.collectives import CommTimer, gather_rows

QUERY_VIEW, KEY_VIEW = 0, 1  # MoCo's im_q and im_k: the first two global views
MOCO_MOMENTUM = 0.999  # MoCo's key encoder momentum m


@dataclass(frozen=True)
class MocoConfig(HeadSettings, ObjectiveConfig):
    """The kernel's fields are ``HeadSettings``' (temperature, chunk_size, kernel, co2_alpha,
    co2_temperature), with MoCo v2's temperature.  Attributes of the method:
    name: "moco".
    queue_size: K keys in the queue (MoCo v2: 65,536), split over the classifier group; a multiple
        of the global batch (the batch size times the ranks), as in MoCo's code.
    momentum: the key encoder's momentum m (MoCo: 0.999), constant.
    """

    name: str = "moco"
    temperature: float = MOCO_TEMPERATURE
    queue_size: int = DEFAULT_QUEUE_SIZE
    momentum: float = MOCO_MOMENTUM

    USUAL_TEMPERATURE = "MoCo v2: 0.2"

    def checks(self) -> list[tuple[bool, str, str]]:
        return [
            *super().checks(),
            (self.queue_size >= 1, "queue_size", "use a positive multiple of the global batch (MoCo v2: 65536)"),
            (0.0 <= self.momentum <= 1.0, "momentum", "use a momentum in [0, 1] (MoCo: 0.999)"),
        ]

    def fingerprint_fields(self) -> tuple[str, ...]:
        return ("name", "queue_size")

    def default_recipe(self) -> str:
        return "moco_v2"

    def student_views(self, views: ViewLayout) -> tuple[int, ...]:
        return (QUERY_VIEW,)

    def teacher_request(self, views: ViewLayout) -> TeacherRequest:
        request = TeacherRequest(views=(KEY_VIEW,), momentum=self.momentum, sync_batch_norm=True,
                                 field="objective.momentum")
        request.check_views(views.global_views)
        return request

    def memory_plan(self, views: ViewLayout) -> QueuedKeys:
        return QueuedKeys(queue_size=self.queue_size, chunk_size=self.chunk_size, kernel=self.kernel,
                          co2=self.co2_alpha > 0)

    def term(self, views: ViewLayout):
        """CO2 rides in the queue's kernel (``queue_loss``), not as the classifier's view-pair term."""
        return None

    def kernel_choice(self, views: ViewLayout, device: torch.device) -> str:
        path = self.kernel_settings().resolved_implementation(device, self.co2_alpha > 0)
        if path == "fused":
            return "queue kernel: fused (Triton; logits stay on the chip)"
        return f"queue kernel: chunked ({'CO2 runs in it' if self.co2_alpha > 0 else f'{device.type} tensors'})"


class MocoObjective(Objective):
    config: MocoConfig

    def __init__(self, config: MocoConfig, context: ObjectiveContext) -> None:
        super().__init__(config, context)
        dims = context.dims
        if context.global_batch < 1:
            raise ValueError("the moco objective needs the job's global batch (ObjectiveContext.global_batch): its "
                             "queue takes whole global batches")
        self.group, self.group_size = dims.classifier_group, dims.classifier_parallel_size
        # Each classifier group holds a whole queue; the first group's ranks write it to checkpoints.
        self.queue = KeyQueue(config.queue_size, context.feature_dim, context.global_batch, dims.classifier_rank,
                              self.group_size, dims.device, context.seed, primary=dims.rank < self.group_size)
        self.comm_timer = CommTimer()
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # the step's keys and ids, to enqueue
        self._last: dict[str, torch.Tensor] = {}

    def loss(self, step: StepViews) -> LossOut:
        query_view, key_view = step.views[0], step.teacher[0]
        query = F.normalize(query_view.features.float(), dim=1)
        key = F.normalize(key_view.features.float(), dim=1)
        alpha = self.config.co2_alpha
        result = queue_infonce(query, key, self.queue.keys, self.config.kernel_settings(), self.group,
                               self.config.co2_temperature if alpha > 0 else None, timer=self.comm_timer,
                               feature_grad_scale=self.group_size)
        valid = self._group_columns(step.valid, step.plan.valid if step.plan is not None else None)
        # The mean over the global batch's valid samples: with several classifier groups each scores its own
        # batch, and the engine's average over every rank divides by the groups as well.
        replicas = self.context.dims.num_classifier_replicas
        count = valid.sum() if step.global_valid is None else step.global_valid / replicas
        per_query = result.loss if result.consistency is None else result.loss + alpha * result.consistency
        loss = (per_query * valid.to(per_query.dtype)).sum() / count
        self._pending = (self._global_keys(result.keys, key), self._global_ids(step))
        if step.validate:
            with torch.no_grad():
                self._last = {"infonce": (result.loss * valid).sum() / count}
                if result.consistency is not None:
                    self._last["co2"] = (result.consistency * valid).sum() / count
        return LossOut(loss)

    def _group_columns(self, local_valid: torch.Tensor, plan_valid) -> torch.Tensor:
        """``[group ranks * b]`` valid flags of the group's gathered batch (from the sampler's plan: no
        collective; gathered when the caller has no plan)."""
        if plan_valid is None:
            return gather_rows(local_valid, self.group)
        first = (self.context.dims.rank // self.group_size) * self.group_size
        return to_device(np.ascontiguousarray(plan_valid[first: first + self.group_size]).reshape(-1),
                         local_valid.device)

    def _global_keys(self, group_keys: torch.Tensor, local_key: torch.Tensor) -> torch.Tensor:
        """Every rank's keys in the sampler's global order: the loss's gathered ones when the group is the
        world; else gathered over the data-parallel group."""
        if self.group_size == self.context.dims.world_size:
            return group_keys
        return gather_rows(local_key.detach(), self.context.dims.data_parallel_group)

    def _global_ids(self, step: StepViews) -> torch.Tensor:
        if step.plan is not None:
            return to_device(np.ascontiguousarray(step.plan.ids).reshape(-1), step.instance_ids.device)
        return gather_rows(step.instance_ids, self.context.dims.data_parallel_group)

    def after_optimizer_step(self, taken: bool | torch.Tensor) -> None:
        """The step's keys enter the queue, unless the step changed nothing (a step DeepSpeed dropped)."""
        keys, ids = self._pending
        self._pending = None
        if taken is True:
            self.queue.enqueue(keys, ids)

    def skip_step(self) -> None:
        self._pending = None  # nothing entered the queue: the step is as if it never ran

    def metrics(self) -> dict[str, float]:
        metrics = {"comm_seconds": self.comm_timer.drain()}
        metrics.update({name: float(value) for name, value in self._last.items()})
        self._last = {}
        return metrics

    def state_dict(self) -> dict:
        return {"queue": self.queue.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.queue.load_state_dict(state["queue"])

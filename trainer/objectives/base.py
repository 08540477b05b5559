"""The objective seam: every training method is one ``Objective``; the trainer only calls this.

An objective owns its parameters and state (a classifier shard, prototypes, queues, tables) and
answers five questions: which optimizers train its parameters (outside ZeRO; the backbone and head
are ZeRO's), what to do when training and each epoch start, the loss of one step, what to do after
backward (gradient averaging, lazy corrections), and its metrics.  It may also ask for a teacher, a
momentum copy of the backbone and head (``ObjectiveConfig.teacher_request``, a
``trainer.objectives.teacher_request.TeacherRequest``): the trainer then hands it the teacher's head
features of the views it names (``StepViews.teacher``) and moves the teacher after every optimizer
step that was taken (``Objective.after_optimizer_step`` follows).  Its checkpoint state is a
nested dict in which row-sharded tensors are wrapped in ``ShardedRows``; ``parallel.sharded_state``
re-splits those by row range, so the state reloads on any number of ranks.

A minimal objective (a replicated linear classifier over instance ids)::

    @dataclass(frozen=True)
    class LinearConfig(ObjectiveConfig):
        name: str = "linear"

        def memory_plan(self, views):  # for `instcls plan` and the dry run (no objective is built)
            # W, its gradient and momentum on every rank, and all its logits
            return ClassifierRows(sharded=False, kernel="chunked", logits_cache_bytes=2**62)

    class Linear(Objective):
        def __init__(self, config, context):
            super().__init__(config, context)
            self.fc = nn.Linear(context.feature_dim, context.num_instances).to(context.dims.device)
            self.sgd = torch.optim.SGD(self.fc.parameters(), lr=0.0, momentum=context.optim.momentum)

        def optimizers(self):
            return [self.sgd]

        def loss(self, step):  # the mean over the valid samples of the global batch
            layout = self.context.views  # the job's views: [views, b] rows on this rank
            logits = self.fc(self.stacked_features(step).float())
            per_sample = F.cross_entropy(logits, layout.per_view(step.instance_ids), reduction="none")
            share = self.context.dims.world_size / (step.global_valid * layout.num_views)  # gradients are averaged
            return LossOut(sum_over_valid(per_sample, layout.per_view(step.valid)) * share)

        def after_backward(self):
            average_gradients(self.fc.parameters(), self.context.dims)   # it is replicated

        def state_dict(self):
            return {"fc": self.fc.state_dict()}

        def load_state_dict(self, state):
            self.fc.load_state_dict(state["fc"])

    register_objective("linear", LinearConfig, Linear)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from data_pipeline.contract import DEFAULT_RECIPE, AugmentConfig, StepIndices, ViewLayout
from trainer.objectives.memory_plan import NoMemoryPlan, ObjectiveMemoryPlan
from trainer.objectives.teacher_request import TeacherRequest
from trainer.optim import OptimizerSettings
from trainer.parallel import ParallelDims
from trainer.parallel.sharded_state import ShardedRows  # noqa: F401 (objectives build their state with it)


@dataclass(frozen=True)
class ObjectiveConfig:
    """Base of every objective's config section (``objective:`` in the job YAML).

    Attributes:
        name: which objective trains the network (see ``trainer.objectives.OBJECTIVES``).
    """

    name: str

    def fingerprint_fields(self) -> tuple[str, ...]:
        """Settings that shape this objective's saved state: a resume under other values is refused
        (``trainer.checkpoint.run_fingerprint``)."""
        return ("name",)

    def default_recipe(self) -> str:
        """The augmentation recipe (``data_pipeline/loading/augment/recipes.py``) a job of this objective
        trains with when ``data.loader.augment.recipe`` is unset: its paper's.  The shipped objectives keep
        MoCo v2's "aug+", what they have always trained with; an objective whose paper uses another
        recipe overrides this."""
        return DEFAULT_RECIPE

    def sizes_split_over_ranks(self) -> dict[str, int]:
        """``{setting: value}`` of the settings this objective divides evenly over the ranks, which
        every world size of an elastic range must therefore divide (``trainer.elastic.world_range``)."""
        return {}

    def memory_plan(self, views: ViewLayout) -> ObjectiveMemoryPlan:
        """What this objective keeps per rank beside the backbone, for ``instcls plan`` and the dry
        run: one of ``trainer.objectives.memory_plan``'s descriptions, from the settings alone (no
        objective is built).  ``views``: the job's view layout.  Without one the planner refuses the
        objective rather than plan it as another."""
        raise NoMemoryPlan(
            f"objective {self.name!r} has no memory plan: implement ObjectiveConfig.memory_plan in "
            f"{type(self).__name__}, returning the description of what it keeps beside the backbone "
            "(trainer.objectives.memory_plan: ClassifierRows, SampledRows, Prototypes, or a new one with its "
            "arithmetic in trainer.planning.objective_memory)")

    def student_views(self, views: ViewLayout) -> tuple[int, ...] | None:
        """Positions, among the job's ``views``, of the views the student (the network being trained)
        encodes each step, in order: ``StepViews.views`` then holds only those.  None (the default):
        every view.  An objective that scores some views only with its teacher (MoCo's keys) saves
        their forward and backward, and the student's BatchNorm sees only the views it trains on."""
        return None

    def teacher_request(self, views: ViewLayout) -> TeacherRequest | None:
        """The teacher this objective needs (a momentum copy of the backbone and head), from the settings
        alone, so the planner counts it without building anything; None (the default): no teacher.
        ``views``: the job's view layout (the request names positions in it)."""
        return None


@dataclass(frozen=True)
class OptimSettings:
    """What an objective's own optimizers share with the backbone's (the schedule sets the lr)."""

    momentum: float
    weight_decay: float
    skips_nonfinite_steps: bool = False  # optim.on_nonfinite: skip_step (updates must wait for the decision)
    # The backbone's optimizer, for parameters a method's paper steps with it (SwAV's prototypes:
    # LARC over the whole model); None: SGD with the momentum and weight decay above.
    backbone_optimizer: OptimizerSettings | None = None


@dataclass(frozen=True)
class ObjectiveContext:
    """Everything an objective may use, passed explicitly (objectives never read globals).

    Attributes:
        dims: the parallel layout (ranks, classifier groups, device).
        num_instances: N, instances in the training set.
        feature_dim: D, width of the head's output.
        seed: the job seed (initial weights depend only on it, never on the layout).
        optim: momentum and weight decay of the job's SGD, and the backbone's optimizer.
        views: the layout of every step's views, fixed for the job (default: the default
            augmentation's two global views).
        global_batch: samples a step takes over all ranks (the loader's batch times the ranks; 0:
            not given, for objectives that do not need it; a queue of whole batches does).
    """

    dims: ParallelDims
    num_instances: int
    feature_dim: int
    seed: int
    optim: OptimSettings
    views: ViewLayout = ViewLayout.of_training(AugmentConfig())
    global_batch: int = 0


@dataclass
class View:
    """Head features of one augmented view of every sample of the local batch."""

    features: torch.Tensor  # [b, D] in the engine's dtype, with autograd history
    kind: str  # "global" (large crop) or "small" (multi-crop)
    index: int  # position among the loader's views (global views first)


@dataclass
class StepViews:
    """The input of one step on one rank.

    ``valid`` is False on padding repeats (the last batch of an epoch): they must contribute
    nothing to the loss or to any update.  ``global_valid`` counts valid samples over all ranks
    (from the sampler, so known without communication).  ``validate`` marks log steps, where
    checking inputs (a host sync) is allowed.  ``plan`` is what the sampler gives every rank this
    step (host arrays, no communication: the loader's ``Batch.plan``); ``next_plan`` the next
    step's in the sampler's sequence, so an objective can prefetch (None when the caller does not
    know).  Features are laid out as ``ObjectiveContext.views``.  ``teacher``: the momentum teacher's
    features when the objective asked for one (``Objective.teacher_request``)."""

    views: list[View]
    instance_ids: torch.Tensor  # [b] int64
    valid: torch.Tensor  # [b] bool
    global_valid: int | None
    epoch: int
    step: int  # global step, 0-based
    validate: bool = False
    plan: StepIndices | None = None
    next_plan: StepIndices | None = None
    # The teacher's head features ([b, D], no autograd history) of the views its request names, in the
    # request's order (``View.index`` says which view each is); [] without a teacher.
    teacher: list[View] = field(default_factory=list)


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar; the trainer runs the engine's backward through it
    # The step's loss over all ranks, to log instead of ``loss`` when ``loss`` is only this rank's
    # share of it (set on log steps, where computing it may sync); None: ``loss`` is that already.
    reported: torch.Tensor | None = None


class Objective:
    """Subclasses set what they need; the defaults do nothing.

    ``skips_on_device``: under ``optim.on_nonfinite: skip_step``, a dropped step can be decided on the
    device with no host read (``trainer.engine.device_skip``): the objective's only per-step state is
    what its ``optimizers()`` step, and each is one of torch's fused optimizers or the registry's.
    False (the default): the trainer agrees before the backward, blocking, and calls ``skip_step``.
    """

    skips_on_device: bool = False

    def __init__(self, config: ObjectiveConfig, context: ObjectiveContext) -> None:
        self.config = config
        self.context = context

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """Optimizers of this objective's parameters, stepped by the trainer after
        ``after_backward``; the trainer sets their learning rate each step from the objective's
        schedule (``optim.objective_base_lr``; the backbone's when unset), except for those of
        ``backbone_lr_optimizers``."""
        return []

    def backbone_lr_optimizers(self) -> list[torch.optim.Optimizer]:
        """Those of ``optimizers()`` built from ``OptimSettings.backbone_optimizer``: parameters a
        method's paper steps with the model's optimizer (SwAV's prototypes) take the backbone's
        learning rate, as they would inside that optimizer."""
        return []

    def on_train_start(self, encode: Callable[[torch.Tensor], torch.Tensor],
                       inference_batches: Callable[[], Iterable]) -> None:
        """Once before the first step of a run (also after a resume).  ``encode`` runs the network
        (train mode, no grad is up to the caller); ``inference_batches()`` iterates the training set
        once through the inference pipeline (``Batch`` objects with ``valid``)."""

    def on_epoch_start(self, epoch: int) -> None:
        """Before the first step of ``epoch`` (e.g. a hard-negative search)."""

    def loss(self, step: StepViews) -> LossOut:
        raise NotImplementedError

    def stacked_features(self, step: StepViews) -> torch.Tensor:
        """The step's ``[views * b, D]`` features, view after view, as ``context.views`` lays them out."""
        layout = self.context.views
        if [view.kind for view in step.views] != list(layout.kinds):
            raise ValueError(
                f"the step's views are {[view.kind for view in step.views]}, the job's layout "
                f"{list(layout.kinds)}: build the ObjectiveContext with the loader's view_layout"
            )
        return torch.cat([view.features for view in step.views])

    def teacher_request(self) -> TeacherRequest | None:
        """The teacher the trainer keeps for this objective (its config's ``teacher_request``)."""
        return self.config.teacher_request(self.context.views)

    def student_views(self) -> tuple[int, ...] | None:
        """The views the student encodes (its config's ``student_views``; None: all), checked against the
        job's layout."""
        wanted = self.config.student_views(self.context.views)
        num_views = self.context.views.num_views
        if wanted is not None and (not wanted or len(set(wanted)) != len(wanted)
                                   or any(not 0 <= v < num_views for v in wanted)):
            raise ValueError(f"objective {self.config.name!r} asks the student for views {list(wanted)}, but the "
                             f"job's loader makes {num_views} views a sample (positions 0 to {num_views - 1}): raise "
                             "data.loader.augment.num_views, or name one or more distinct positions")
        return wanted

    def after_backward(self) -> None:
        """After the backward, before the optimizers step (gradient averaging, corrections)."""

    def after_optimizer_step(self, taken: bool | torch.Tensor) -> None:
        """After the backbone's and this objective's optimizers stepped and the teacher (if any) moved:
        what must follow the step (a queue's enqueue).  ``taken``: whether the step changed anything:
        a host bool, or under ``optim.on_nonfinite: skip_step`` decided on the device a 0-dim bool
        tensor, which must not be read on the host (mask with it: ``torch.where``).  Not called for a
        step dropped before its backward (``skip_step`` is, instead)."""

    def skip_step(self) -> None:
        """Called instead of the backward, ``after_backward`` and the optimizers when some rank's
        loss of this step is NaN or inf (``optim.on_nonfinite: skip_step``): every state must be as
        it was before ``loss()``, so ``loss()`` must not change state that this cannot restore."""

    def metrics(self) -> dict[str, float]:
        """Host values for the log (called on log steps and at epoch ends).  ``comm_seconds``, if
        present, is time spent in collectives since the last call."""
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def objective_parameters(objective: Objective) -> list[torch.Tensor]:
    """Every parameter the objective's optimizers train (for non-finite checks and byte counts)."""
    return [p for optimizer in objective.optimizers() for group in optimizer.param_groups for p in group["params"]]


@torch.no_grad()
def average_gradients(parameters: Iterable[torch.Tensor], dims: ParallelDims) -> None:
    """What DDP does: average the gradients of replicated parameters over all ranks."""
    if not dims.is_distributed:
        return
    for parameter in parameters:
        if parameter.grad is not None:
            dist.all_reduce(parameter.grad, group=dims.data_parallel_group)
            parameter.grad.div_(dims.world_size)


@dataclass
class _Registered:
    config: type
    objective: type


OBJECTIVES: dict[str, _Registered] = {}


def register_objective(name: str, config_class: type, objective_class: type) -> None:
    """Make ``objective: {name: NAME}`` select ``objective_class`` configured by ``config_class``."""
    OBJECTIVES[name] = _Registered(config_class, objective_class)


def objective_config_class(name: str) -> type:
    if name not in OBJECTIVES:
        raise ValueError(f"name={name!r} is invalid: choose one of {sorted(OBJECTIVES)}")
    return OBJECTIVES[name].config


def build_objective(config: ObjectiveConfig, context: ObjectiveContext) -> Objective:
    return OBJECTIVES[config.name].objective(config, context)

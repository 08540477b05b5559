"""The typed job configuration: YAML in, validated dataclasses out.

Every section is a dataclass whose docstring documents its fields and whose ``__post_init__``
rejects bad values with a message naming the field and the fix.  Unknown keys are errors (with a
suggestion), so a typo never silently falls back to a default.

    config = load_job_config("configs/digits_cpu.yaml", overrides=["optim.epochs=3"])
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field, replace
from pathlib import Path

import yaml

import ds_configs
from data_pipeline.contract import LoaderConfig, S3Url, StorageSettings
from trainer.config_building import ConfigError, apply_overrides, build_dataclass
from trainer.config_elastic import ElasticSettings
from trainer.config_tracking import MlflowSettings
from trainer.eval_config import EvalSection
from trainer.models import ModelConfig
from trainer.objectives import ObjectiveConfig, OptimSettings, default_objective_config
from trainer.observability.tensorboard_scalars import tensorboard_missing
from trainer.optim import OPTIMIZERS, OptimizerSettings, optimizer_names
from trainer.parallel.device_choice import DEVICE_CHOICES

__all__ = ["ConfigError", "JobConfig", "apply_overrides", "load_job_config"]


@dataclass(frozen=True)
class DataSection:
    """Attributes:
    train_shards: the training shard set (with manifest.json): a directory, or ``s3://bucket/prefix``
        on S3-compatible object storage.
    eval_shards: labelled held-out shard set for kNN evaluation at the end (optional); a directory
        or an s3:// URL.
    knn_bank_shards: labelled shard set whose features form the kNN memory bank; defaults to
        train_shards; a directory or an s3:// URL.
    loader: batch size per rank, backend, threads, augmentation (see ``LoaderConfig``).
    storage: how s3:// sets are reached (endpoint, region, addressing, requests in flight, retry
        time; see ``StorageSettings``); credentials come from the environment, never the config.
    """

    train_shards: S3Url | Path
    eval_shards: S3Url | Path | None = None
    knn_bank_shards: S3Url | Path | None = None
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    storage: StorageSettings = field(default_factory=StorageSettings)


@dataclass(frozen=True)
class ParallelSection:
    """Attributes:
    classifier_parallel_size: ranks one sharded classifier spans; a divisor of the world size
        (default: all ranks, the paper's DHP).  Several groups replicate the shards.
    device: "auto" (the GPU cuda:LOCAL_RANK when CUDA starts, else the CPU), "cuda" (a GPU or a
        clear error naming the driver and CUDA versions: cluster jobs, so a node whose driver is
        too old for the wheel never trains on CPU unnoticed) or "cpu".
    deterministic: run every kernel deterministically (``torch.use_deterministic_algorithms``,
        a fixed cuBLAS workspace, no cuDNN autotuning), so that a resumed run is bit-identical to
        an uninterrupted one on GPU hosts too (CPU kernels already are).  Slower on CUDA, and an op
        without a deterministic kernel raises instead of running; off by default.
    collectives_over_one_rank: in a job of one rank, run the code that several ranks run, over a
        group of one: SyncBatchNorm's synchronised path (its all-gather, all-reduce and, on a GPU,
        torch's fused kernels) and the device skip's all-reduce.  For checking those paths on one
        GPU (``tests/integration/test_gpu_step_host_syncs.py``); off by default, and no effect on
        a job of several ranks, which runs them anyway.
    elastic: an elastic launch's settings (``ElasticSettings``: its memory check at the smallest size).
    collective_timeout_s: how long the rendezvous store and every collective wait for the slowest
        rank before the job fails (torchrun then restarts the ranks).  Above a checkpoint save's and
        the end-of-run evaluation's longest wait; the pod drills shorten it.
    """

    classifier_parallel_size: int | None = None
    device: str = "auto"
    deterministic: bool = False
    collectives_over_one_rank: bool = False
    elastic: ElasticSettings = field(default_factory=ElasticSettings)
    collective_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.device not in DEVICE_CHOICES:
            raise ConfigError(f"parallel.device={self.device!r} is invalid: use auto (GPU if CUDA starts, else "
                              "CPU), cuda (GPU or fail) or cpu")
        if self.classifier_parallel_size is not None and self.classifier_parallel_size < 1:
            raise ConfigError(f"parallel.classifier_parallel_size={self.classifier_parallel_size} is invalid: use a "
                              "positive divisor of the world size, or leave it out (all ranks)")
        if not isinstance(self.deterministic, bool):
            raise ConfigError(f"parallel.deterministic={self.deterministic!r} is invalid: use true or false")
        if not isinstance(self.collectives_over_one_rank, bool):
            raise ConfigError(f"parallel.collectives_over_one_rank={self.collectives_over_one_rank!r} is invalid: use "
                              "true or false")
        if isinstance(self.collective_timeout_s, bool) or not isinstance(self.collective_timeout_s, (int, float)) \
                or not self.collective_timeout_s > 0:
            raise ConfigError(f"parallel.collective_timeout_s={self.collective_timeout_s!r} is invalid: use a number "
                              "of seconds above 0 (600 by default)")


@dataclass(frozen=True)
class OptimSection:
    """Attributes:
    epochs: training epochs.
    base_lr: learning rate at ``base_batch`` images per step; scaled linearly with the global
        batch (paper: 0.48 at 4096).
    base_batch: the batch size ``base_lr`` refers to.
    objective_base_lr: the learning rate of the objective's own optimizers (the classifier rows'
        SGD of instance and PIC) at ``base_batch`` images per step, scaled by the same linear rule
        and following the same warm-up and cosine (and ``min_lr_ratio``); null (default):
        ``base_lr``, one schedule for both.  For a backbone whose optimizer wants another scale: a
        ViT on AdamW at ``base_lr`` ~1e-3 while the rows' SGD needs ~0.5.  Parameters the
        objective steps with the backbone's optimizer take ``base_lr``'s schedule: SwAV's
        prototypes, which its code steps with the model's optimizer (``optim.name``'s), so this
        field changes nothing in a SwAV job.  A schedule setting, not saved state: a checkpoint
        resumes under another value.
    objective_weight_decay: the weight decay of the objective's own optimizers (the rows' SGD);
        null (default): ``weight_decay``.  AdamW's ViT recipes decay the backbone by 0.05-0.1, which
        at the rows' SGD learning rate of ~0.5 would shrink every row by ~5% a step; the paper's
        SGD decays them by 1e-4.  Like ``objective_base_lr``, refused for SwAV (its prototypes
        step with the backbone's optimizer).
    warmup_epochs: linear warm-up length, then cosine decay to ``min_lr_ratio * lr``.
    name: the backbone's optimizer (``trainer.optim``): "sgd" (default; One-Million-Way, PIC),
        "lars" (SwAV: LARC's scaling form around SGD with momentum, exact under every ZeRO stage)
        or "adamw" (ViTs).  The objective's own parameters (classifier rows) keep SGD, except
        SwAV's prototypes, which its code steps with the backbone's optimizer.
    momentum, weight_decay: SGD's (and LARS's) momentum and the weight decay, of the backbone and
        the objective's optimizers (0.9, 1e-4).
    exclude_from_decay: put norms (BatchNorm/LayerNorm weights), biases, position embeddings and
        class tokens in a group without weight decay that LARS does not adapt either (the
        SimCLR/BYOL convention); null (default): the optimizer's convention (sgd: false, lars
        and adamw: true).  SwAV's code excludes nothing: its config sets false.
    betas, eps: AdamW's moment decays (0.9, 0.999) and denominator guard (1e-8); ``eps`` is also
        the guard of LARS's trust ratio.
    trust_coefficient: LARS's trust coefficient (0.001, SwAV's).
    weight_decay_end: when set, the decayed group's weight decay follows a cosine from
        ``weight_decay`` to this value over the training (DINO's ViT recipe: 0.04 to 0.4);
        null: constant.
    clip_grad_norm: clip the backbone's gradient to this global L2 norm before each step (ViT
        recipes: 1.0 or 3.0); 0 (default): no clipping.  DeepSpeed does it (its
        ``gradient_clipping``), from the gradient norm it computes each step: a DeepSpeed config
        with ``zero_optimization.compute_grad_norm: false`` is refused with clipping on.  The
        objective's own parameters are not clipped.
    on_nonfinite: what a NaN or inf loss on any rank does.  "stop" (default): found at no cost on
        the device, the run stops at the next log step or save with the last good checkpoint
        named.  "skip_step": the step's update is dropped on every rank (weights, momentum, the
        objective's state and BatchNorm statistics stay as before it) and counted.  With
        ``instance`` at ZeRO stage 0 the decision is a flag on the device (a NaN or inf loss or
        gradient), read on log steps only (``trainer.engine.device_skip``); otherwise it is made
        before the backward from the loss, one flag read from the device per step, folded into
        the step's SIGTERM all-reduce.
    max_skipped_in_a_row: under "skip_step", stop after this many consecutive skipped steps
        (the model itself has gone bad, not one batch).
    """

    epochs: int = 200
    base_lr: float = 0.48
    base_batch: int = 4096
    objective_base_lr: float | None = None
    objective_weight_decay: float | None = None
    warmup_epochs: float = 10.0
    min_lr_ratio: float = 0.0
    momentum: float = 0.9
    weight_decay: float = 1e-4
    on_nonfinite: str = "stop"
    max_skipped_in_a_row: int = 10
    name: str = "sgd"
    exclude_from_decay: bool | None = None
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    trust_coefficient: float = 0.001
    weight_decay_end: float | None = None
    clip_grad_norm: float = 0.0

    def __post_init__(self) -> None:
        checks = [
            (self.epochs >= 1, "epochs", "train at least 1 epoch"),
            (self.base_lr > 0, "base_lr", "use a positive learning rate (paper: 0.48 at batch 4096)"),
            (self.base_batch >= 1, "base_batch", "use the batch size base_lr was tuned for (4096)"),
            (self.objective_base_lr is None or self.objective_base_lr > 0, "objective_base_lr",
             "use a positive learning rate for the objective's own optimizers at base_batch (e.g. 0.48 at 4096), "
             "or null to use base_lr"),
            (0 <= self.warmup_epochs <= self.epochs, "warmup_epochs", "use 0 <= warmup_epochs <= epochs"),
            (0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "use a ratio in [0, 1]"),
            (0 <= self.momentum < 1, "momentum", "use 0 <= momentum < 1"),
            (self.weight_decay >= 0, "weight_decay", "use a non-negative weight decay"),
            (self.objective_weight_decay is None or self.objective_weight_decay >= 0, "objective_weight_decay",
             "use a non-negative weight decay for the objective's own optimizers (paper: 1e-4), or null to use "
             "weight_decay"),
            (self.on_nonfinite in ("stop", "skip_step"), "on_nonfinite", "use 'stop' or 'skip_step'"),
            (self.max_skipped_in_a_row >= 1, "max_skipped_in_a_row", "allow at least 1 skipped step in a row"),
            (self.name in optimizer_names(), "name", f"choose one of {', '.join(optimizer_names())}"),
            (self.exclude_from_decay in (None, True, False), "exclude_from_decay",
             "use true, false or null (the optimizer's convention)"),
            (all(0 <= beta < 1 for beta in self.betas), "betas", "use two decays in [0, 1), e.g. [0.9, 0.999]"),
            (self.eps > 0, "eps", "use a small positive guard, e.g. 1e-8"),
            (self.trust_coefficient > 0, "trust_coefficient", "use a positive coefficient (SwAV: 0.001)"),
            (self.weight_decay_end is None or self.weight_decay_end >= 0, "weight_decay_end",
             "use a non-negative weight decay, or null to keep weight_decay constant"),
            (self.clip_grad_norm >= 0, "clip_grad_norm", "use a positive norm to clip to, or 0 for no clipping"),
        ]
        for ok, name, fix in checks:
            if not ok:
                raise ConfigError(f"optim.{name}={getattr(self, name)!r} is invalid: {fix}")
        for name in ("betas", "eps", "trust_coefficient"):  # another optimizer's setting, changed, is a mistake
            readers = [spec.name for spec in OPTIMIZERS.values() if name in spec.reads]
            if getattr(self, name) != getattr(OptimSection, name) and self.name not in readers:
                raise ConfigError(f"optim.{name}={getattr(self, name)!r} is set, but optim.name={self.name!r} does not "
                                  f"read it (only {', '.join(readers)} does): remove it or choose that optimizer")

    def objective_settings(self, skips_nonfinite_steps: bool = False) -> OptimSettings:
        """What the objective's own optimizers use (``trainer.objectives.OptimSettings``)."""
        weight_decay = self.weight_decay if self.objective_weight_decay is None else self.objective_weight_decay
        return OptimSettings(momentum=self.momentum, weight_decay=weight_decay,
                             skips_nonfinite_steps=skips_nonfinite_steps, backbone_optimizer=self.optimizer_settings())

    def optimizer_settings(self) -> OptimizerSettings:
        """The backbone optimizer's settings (``trainer.optim``)."""
        return OptimizerSettings(name=self.name, momentum=self.momentum, weight_decay=self.weight_decay,
                                 betas=self.betas, eps=self.eps, trust_coefficient=self.trust_coefficient,
                                 exclude_from_decay=self.exclude_from_decay)


@dataclass(frozen=True)
class CheckpointSection:
    """Attributes:
    dir: where checkpoints go (one sub-directory per save, written atomically).
    every_epochs: save at the end of every n-th epoch (0: never at epoch ends).
    every_steps: also save every n steps (0: off).
    keep_last: complete checkpoints to keep (2): once a save is complete, all but the newest
        ``keep_last`` are deleted, so the newest complete one never is.  A save in flight counts
        for none until it is complete: the disk holds up to ``keep_last`` + 1.
    keep: the former name of ``keep_last``, still read (give one of the two).
    """

    dir: Path = Path("checkpoints")
    every_epochs: int = 1
    every_steps: int = 0
    keep_last: int = 2
    keep: int | None = None

    def __post_init__(self) -> None:
        for name in ("every_epochs", "every_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"checkpoint.{name}={getattr(self, name)} is invalid: use 0 (off) or a positive "
                                  "interval")
        if self.keep is not None:
            if self.keep < 1:
                raise ConfigError(f"checkpoint.keep={self.keep} is invalid: keep is the former name of keep_last; "
                                  "use checkpoint.keep_last >= 1")
            if self.keep_last not in (CheckpointSection.keep_last, self.keep):
                raise ConfigError(f"checkpoint.keep={self.keep} and checkpoint.keep_last={self.keep_last} disagree: "
                                  "keep is the former name of keep_last; give only keep_last")
            object.__setattr__(self, "keep_last", self.keep)
        if not isinstance(self.keep_last, int) or self.keep_last < 1:
            raise ConfigError(f"checkpoint.keep_last={self.keep_last!r} is invalid: keep at least the newest complete "
                              "checkpoint (1); 2 (the default) also keeps the one before it, in case the newest is "
                              "damaged")


@dataclass(frozen=True)
class LoggingSection:
    """Attributes:
    dir: JSON-lines logs, one file per rank.
    log_every: steps between log lines (and the only steps with host syncs for metrics).
    metrics_port: Prometheus port of local rank 0; local rank r serves port + r (0 disables).
    metrics_bind: address the metrics endpoint listens on: "0.0.0.0" (all interfaces, what a
        Prometheus in the cluster needs) or e.g. "127.0.0.1" to keep it on the machine.
    progress: rank 0 shows its progress: tqdm's bar on a terminal; elsewhere (a file, a pod log)
        plain lines (epoch, step, loss, images/s, data wait, ETA) at log steps, at most one per
        ``progress_every_s`` seconds.
    consumed_ids: log the instance ids each step trained on, per rank (``event: consumed``), for
        per-sample accounting across restarts (the fault drills); one host sync and a log line per
        step, so off for real runs.
    tensorboard: rank 0 also writes every number of its log's step, evaluation and summary records
        as TensorBoard scalars under ``dir``/tensorboard/ (tags such as ``train/loss``,
        ``eval/knn_trained``), for runs watched without Prometheus; needs the optional
        ``tensorboard`` package (``pip install 'instcls[tensorboard]'``).  Off by default.
    trainjob_status: rank 0 reports the run's progress (percentage, remaining seconds, loss,
        images/s, the last kNN accuracy) into its Kubeflow Trainer TrainJob's status, at most every
        ``progress_every_s`` seconds, through the endpoint the TrainJob runtime injects
        (``trainer.observability.trainjob_status``).  A report that fails logs one warning and
        training goes on.  Off by default; on in ``k8s/overlays/trainjob``.
    mlflow: rank 0 mirrors the run into an MLflow run (``MlflowSettings``: tracking URI, experiment,
        run name, request limits): params, every scalar of the JSON log, tags, run.json, the summary
        and the model card; off while ``tracking_uri`` is empty.
    """

    dir: Path = Path("logs")
    log_every: int = 10
    metrics_port: int = 9400
    metrics_bind: str = "0.0.0.0"
    progress: bool = True
    progress_every_s: float = 30.0
    consumed_ids: bool = False
    tensorboard: bool = False
    trainjob_status: bool = False
    mlflow: MlflowSettings = field(default_factory=MlflowSettings)

    def __post_init__(self) -> None:
        if not isinstance(self.trainjob_status, bool):
            raise ConfigError(f"logging.trainjob_status={self.trainjob_status!r} is invalid: use true or false")
        if self.log_every < 1:
            raise ConfigError(f"logging.log_every={self.log_every} is invalid: use a number of steps >= 1")
        if not isinstance(self.tensorboard, bool):
            raise ConfigError(f"logging.tensorboard={self.tensorboard!r} is invalid: use true or false")
        if self.tensorboard and (missing := tensorboard_missing()) is not None:
            raise ConfigError(missing)
        if not self.progress_every_s >= 0:
            raise ConfigError(f"logging.progress_every_s={self.progress_every_s} is invalid: use seconds >= 0 "
                              "(0: a line at every log step)")
        if not 0 <= self.metrics_port < 65536:
            raise ConfigError(f"logging.metrics_port={self.metrics_port} is invalid: use 0 (off) or a TCP port")
        try:
            ipaddress.ip_address(self.metrics_bind)
        except ValueError:
            raise ConfigError(f"logging.metrics_bind={self.metrics_bind!r} is invalid: use an IP address such as "
                              "0.0.0.0 (all interfaces) or 127.0.0.1 (this machine only)") from None


@dataclass(frozen=True)
class JobConfig:
    """A training job.  ``objective`` selects the training method by ``name`` (see
    ``trainer.objectives``); its other fields are that objective's.  ``deepspeed_config`` is a
    DeepSpeed JSON file (ZeRO stage, bf16): a shipped one by name (``zero2_bf16``) or as
    ``ds_configs/zero2_bf16.json``, found from any working directory, or a path of your own,
    relative to the job config's folder or the working directory (``ds_configs.resolve``);
    batch sizes in it are filled in from ``data.loader.batch_size``.  ``max_steps`` stops early
    (for tests and smoke runs).

    ``seed`` is the run's one seed: the initial weights (backbone, head, the objective's rows or
    prototypes), and, unless ``data.loader.seed`` is set, the order the samples are read in and
    every augmentation parameter (docs/training.md lists what each seed controls).  Likewise an unset
    ``data.loader.augment.recipe`` becomes the objective's ``default_recipe()``, its paper's."""

    data: DataSection
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: ObjectiveConfig = field(default_factory=default_objective_config)
    parallel: ParallelSection = field(default_factory=ParallelSection)
    optim: OptimSection = field(default_factory=OptimSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    logging: LoggingSection = field(default_factory=LoggingSection)
    eval: EvalSection = field(default_factory=EvalSection)
    deepspeed_config: Path = Path("ds_configs/zero0.json")
    seed: int = 0
    max_steps: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} is invalid: use a non-negative integer")
        if self.max_steps is not None and self.max_steps < 1:
            raise ConfigError(f"max_steps={self.max_steps!r} is invalid: use a number of steps >= 1, or leave it unset "
                              "(null) to train for optim.epochs")
        if self.data.loader.seed is None:  # one seed: the data order and the views follow the weights' seed
            object.__setattr__(self, "data", replace(self.data, loader=replace(self.data.loader, seed=self.seed)))
        if self.data.loader.augment.recipe is None:  # the objective's paper's augmentation
            augment = replace(self.data.loader.augment, recipe=self.objective.default_recipe())
            object.__setattr__(self, "data", replace(self.data, loader=replace(self.data.loader, augment=augment)))


def load_job_config(path: Path | str, overrides: list[str] | None = None) -> JobConfig:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} not found; see configs/ for examples")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{path} is not valid YAML: {error}") from error
    data = apply_overrides(data, overrides or [])
    try:
        config = build_dataclass(JobConfig, data, "")
        return replace(config, deepspeed_config=ds_configs.resolve(config.deepspeed_config, path.parent))
    except ValueError as error:  # ConfigError, or a deepspeed_config that is nowhere
        raise ConfigError(f"{path}: {error}") from error

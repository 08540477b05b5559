"""The job config's ``eval`` section: kNN and the linear probe on frozen features (kept apart from
``trainer.config``, which holds the other sections and the loading)."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config_building import ConfigError

PROBE_METHODS = ("auto", "sgd", "sklearn")


@dataclass(frozen=True)
class LinearProbeSection:
    """Attributes:
    method: how the linear probe is fitted.  "sgd": every rank trains on its own rows of the cached
        features, data parallel, with a small sweep of learning rate and weight decay
        (``trainer.evaluation.linear_sgd``), on the job's devices; the path for large banks.
        "sklearn": scikit-learn's LogisticRegression on rank 0, on the whole bank gathered into its
        host memory, for as long as it takes (exact, for small banks; the reference the tests
        compare "sgd" with).  "auto" (default): "sgd" from ``sgd_from_samples`` bank samples, else
        "sklearn".
    sgd_from_samples: the bank size from which "auto" picks "sgd" (20,000: below it scikit-learn's
        fit takes seconds to a minute on one core; at ImageNet-1K's 1.28M x 2048 it would take hours
        and 10 GB on rank 0).
    epochs: passes of "sgd" over the cached features (30).
    batch_size: rows of all ranks in one "sgd" step (1024); each step all-reduces every head's gradient.
        A bank of fewer than 16 batches is cut into 16 smaller ones, so that it still gets 16 steps an epoch.
    learning_rates, weight_decays: the sweep: one head per pair, trained side by side in one pass;
        the head with the best top-1 on the held-out part of the bank is scored on the eval shards
        and logged with its choice.  Features are standardised (global mean and variance), so one
        grid fits any backbone.
    momentum: SGD momentum of "sgd" (0.9); the learning rate follows a cosine to 0.
    held_out: the share of the bank (chosen by id, the same on every rank) that scores the sweep and
        is not trained on (0.1).
    seed: which rows are held out, the mini-batches of each epoch and the label fractions (0).
    """

    method: str = "auto"
    sgd_from_samples: int = 20_000
    epochs: int = 30
    batch_size: int = 1024
    learning_rates: tuple[float, ...] = (0.01, 0.03, 0.1, 0.3)
    weight_decays: tuple[float, ...] = (0.0, 1e-4)
    momentum: float = 0.9
    held_out: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        checks = [
            (self.method in PROBE_METHODS, "method", f"choose one of {', '.join(PROBE_METHODS)}"),
            (self.sgd_from_samples >= 0, "sgd_from_samples", "use a number of bank samples (0: always sgd)"),
            (self.epochs >= 1, "epochs", "train at least 1 epoch"),
            (self.batch_size >= 1, "batch_size", "use at least 1 row per step (all ranks together)"),
            (len(self.learning_rates) >= 1 and all(lr > 0 for lr in self.learning_rates), "learning_rates",
             "give one or more positive learning rates"),
            (len(self.weight_decays) >= 1 and all(wd >= 0 for wd in self.weight_decays), "weight_decays",
             "give one or more non-negative weight decays"),
            (0 <= self.momentum < 1, "momentum", "use 0 <= momentum < 1"),
            (0 < self.held_out < 1, "held_out", "hold out a share of the bank in (0, 1), e.g. 0.1"),
            (self.seed >= 0, "seed", "use a non-negative seed"),
        ]
        for ok, name, fix in checks:
            if not ok:
                raise ConfigError(f"eval.linear.{name}={getattr(self, name)!r} is invalid: {fix}")

    def method_for(self, bank_samples: int) -> str:
        """"sgd" or "sklearn" for a bank of ``bank_samples``."""
        if self.method != "auto":
            return self.method
        return "sgd" if bank_samples >= self.sgd_from_samples else "sklearn"


@dataclass(frozen=True)
class EvalSection:
    """Attributes:
    knn_k: neighbours of the weighted kNN classifier (20).
    knn_temperature: temperature of the kNN vote weights exp(sim / t) (0.07).
    knn_at_end: after training, print kNN accuracy of the trained and the random-init network.
    every_epochs: also score kNN every this many epochs while training (0: only at the end).  All
        ranks extract features together; it costs about one pass over the bank and held-out
        shards, in inference mode.  Logged as ``event: eval`` and exported as
        ``instcls_eval_knn_accuracy``.
    linear_at_end: after training, also fit a linear probe on the frozen features (trained and
        random init) and its learning curve over fractions of the labels (``linear``: how).  It runs
        with or without ``knn_at_end``.
    linear: the probe's method and settings (``LinearProbeSection``).
    bank_dtype: how each rank stores its rows of the kNN bank, on its device: "float32" (default)
        or "float16" (half the memory; rows are still normalised and scored in float32, so only the
        features' rounding changes).  Each rank holds only the rows of the samples it extracted
        (about N / ranks); queries are all-gathered and the ranks' top-k lists merged exactly.
    bank_samples: use only this many bank samples (a fixed subset, the same on every rank and run,
        chosen by ``bank_subset_seed``; only they are read), or null (default) for all of them.
        For banks too large to extract or hold, e.g. ImageNet-21K.  The linear probe uses it too.
    bank_subset_seed: which fixed subset ``bank_samples`` picks (0).

    Every setting here needs ``data.eval_shards``: without it evaluation is off, and the start-up
    log says so in one line.
    """

    knn_k: int = 20
    knn_temperature: float = 0.07
    knn_at_end: bool = True
    every_epochs: int = 0
    linear_at_end: bool = False
    linear: LinearProbeSection = field(default_factory=LinearProbeSection)
    bank_dtype: str = "float32"
    bank_samples: int | None = None
    bank_subset_seed: int = 0

    def __post_init__(self) -> None:
        if self.bank_dtype not in ("float32", "float16"):
            raise ConfigError(f"eval.bank_dtype={self.bank_dtype!r} is invalid: use 'float32' or 'float16' (half the "
                              "bank's memory)")
        if self.bank_samples is not None and self.bank_samples < 1:
            raise ConfigError(f"eval.bank_samples={self.bank_samples} is invalid: use a positive number of bank "
                              "samples, or null for the whole bank")
        if self.bank_subset_seed < 0:
            raise ConfigError(f"eval.bank_subset_seed={self.bank_subset_seed} is invalid: use a non-negative seed")
        if self.knn_k < 1:
            raise ConfigError(f"eval.knn_k={self.knn_k} is invalid: use at least 1 neighbour")
        if not self.knn_temperature > 0:
            raise ConfigError(f"eval.knn_temperature={self.knn_temperature} is invalid: use a positive temperature "
                              "(0.07)")
        if self.every_epochs < 0:
            raise ConfigError(f"eval.every_epochs={self.every_epochs} is invalid: use 0 (only at the end) or a "
                              "positive number of epochs")

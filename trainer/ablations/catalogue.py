"""The published ablations, in miniature: what each paper compared, what it found, and the
variants that repeat the comparison on the demo's digit scenes.

Every variant starts from the demo's recipe (``configs/demo_cpu.yaml``) shortened to
``ABLATION_EPOCHS`` and changes only what its ablation is about, so two variants of one ablation
differ in exactly one thing.  A variant that is the demo's recipe sets nothing, so it is the same
run (same config, same hash) in every ablation that uses it.  Claims say which direction the
paper found; ``trainer.ablations.verdict`` judges them against the measured means and the seeds'
spread, whichever way they come out.
"""

from __future__ import annotations

from dataclasses import dataclass

# 10 of the demo's 24 epochs: about 80 s per run on 2 CPU ranks, which keeps the 26 runs of two
# seeds under 40 minutes.  The trained network ends ~5-10 points of kNN above its random init;
# much shorter runs barely leave it.
ABLATION_EPOCHS = 10
EVAL_EVERY = 2  # ~1.2 s each; the same for every run, so the demo's recipe is one run in 3 ablations
EARLY_EPOCH = 4  # Table 4's "early": 40% of the run

# One-Million-Way's K = 100 hardest of 1.28M instances means ~8% of one ImageNet class (1,281 images).
# The scenes have ~144 training images per digit, so the same share is K ~ 10.
SCALED_TOP_K = 10

# PIC and SwAV on the scenes: the demo's data, backbone and colour recipe with the objective
# sections of configs/pic_demo_cpu.yaml and configs/swav_demo_cpu.yaml (a test keeps them equal).
PIC_OBJECTIVE = {
    "name": "pic",
    "temperature": 0.2,
    "chunk_size": 4096,
    "negatives": "recent",
    "queue_size": 256,
    "row_store": "host",
}
SLIDING_WINDOW = "data.loader.sampler.kind=sliding_window"
EPOCH_ORDER = "data.loader.sampler.kind=epoch_permutation"
SWAV_OBJECTIVE = {
    "name": "swav",
    "num_prototypes": 3000,
    "temperature": 0.1,
    "epsilon": 0.05,
    "sinkhorn_iterations": 3,
    "freeze_prototypes_steps": 22,
    "queue_length": 512,
    "queue_start_epoch": 2,
}
SWAV_LR = "optim.base_lr=0.1"  # plain SGD without LARS: the demo's 0.48 collapses SwAV's codes
# Two small crops, not SwAV's six: with one CPU core per rank, DALI's crops dominate the step
# (four small crops made an epoch 2.6x longer).
MULTI_CROP = (
    "data.loader.augment.small_crops=2",
    "data.loader.augment.small_size=16",
    "data.loader.augment.small_scale=[0.25, 0.5]",
)


@dataclass(frozen=True)
class Variant:
    """One arm of an ablation.  ``objective`` replaces the demo config's whole objective section
    (another method); ``overrides`` are ``section.field=value`` settings on top."""

    label: str
    overrides: tuple[str, ...] = ()
    objective: dict | None = None


@dataclass(frozen=True)
class Claim:
    """The paper's finding as a comparison of two variants' kNN accuracy.

    kind:
        "beats": ``better`` scores higher than ``worse``.
        "at_least": ``better`` scores no lower than ``worse``.
        "gap_shrinks": ``better`` leads ``worse`` at ``epoch`` by more than at the end.
    epoch: the evaluation epoch compared (None: the end of training).
    """

    kind: str
    better: str
    worse: str
    epoch: int | None = None

    def describe(self) -> str:
        when = f" at epoch {self.epoch}" if self.epoch is not None else ""
        return {
            "beats": f"{self.better} > {self.worse}{when}",
            "at_least": f"{self.better} >= {self.worse}{when}",
            "gap_shrinks": f"gap {self.better} - {self.worse} shrinks from epoch {self.epoch} to the end",
        }[self.kind]


@dataclass(frozen=True)
class Ablation:
    name: str
    title: str
    source: str
    published: str
    variants: tuple[Variant, ...]
    claims: tuple[Claim, ...]
    note: str = ""
    curves: bool = False  # plot kNN per epoch (the claim is about the course of training)

    def variant(self, label: str) -> Variant:
        for variant in self.variants:
            if variant.label == label:
                return variant
        raise KeyError(f"ablation {self.name} has no variant {label!r}")


ABLATIONS: tuple[Ablation, ...] = (
    Ablation(
        name="init",
        title="Contrastive-prior vs Gaussian initialisation of the classifier",
        source="One-Million-Way, Table 4",
        published="Initialising W from the random network's own features beats Gaussian rows early "
        "in training; the gap shrinks as training goes on.",
        variants=(Variant("contrastive prior"), Variant("Gaussian", ("objective.contrastive_prior=false",))),
        claims=(
            Claim("beats", "contrastive prior", "Gaussian", epoch=EARLY_EPOCH),
            Claim("gap_shrinks", "contrastive prior", "Gaussian", epoch=EARLY_EPOCH),
        ),
        curves=True,
    ),
    Ablation(
        name="head",
        title="MLP head vs a linear head",
        source="One-Million-Way, Table 2",
        published="A 2-layer MLP head before the classifier improves the backbone's features.",
        variants=(Variant("MLP head"), Variant("linear head", ("model.head=linear",))),
        claims=(Claim("beats", "MLP head", "linear head"),),
    ),
    Ablation(
        name="smoothing",
        title="Top-K hardest label smoothing, and its K and alpha",
        source="One-Million-Way, Tables 2 and 5",
        published="Smoothing the labels over the K = 100 hardest instances with alpha = 0.2 is at least "
        "as good as no smoothing; Table 5 sweeps K and alpha around that choice.",
        variants=(
            Variant("none"),
            Variant(f"K={SCALED_TOP_K}, a=0.2", ("objective.smoothing_alpha=0.2", f"objective.top_k={SCALED_TOP_K}")),
            Variant(
                f"K={3 * SCALED_TOP_K}, a=0.2", ("objective.smoothing_alpha=0.2", f"objective.top_k={3 * SCALED_TOP_K}")
            ),
            Variant(f"K={SCALED_TOP_K}, a=0.4", ("objective.smoothing_alpha=0.4", f"objective.top_k={SCALED_TOP_K}")),
        ),
        claims=(Claim("at_least", f"K={SCALED_TOP_K}, a=0.2", "none"),),
        note=f"K = 100 of 1.28M instances is ~8% of an ImageNet class; the same share of a digit's ~144 "
        f"training scenes is K = {SCALED_TOP_K}.",
    ),
    Ablation(
        name="negatives",
        title="Full softmax vs recent-negative sampling (PIC)",
        source="One-Million-Way, Table 3 / PIC",
        published="Scoring only the batch plus the K most recent instances loses little against the full "
        "softmax over all N; the full softmax stays slightly better.",
        variants=(
            Variant("all negatives", ("objective.negatives=all", SLIDING_WINDOW), PIC_OBJECTIVE),
            Variant("recent K=256", (SLIDING_WINDOW,), PIC_OBJECTIVE),
            Variant("recent K=64", ("objective.queue_size=64", SLIDING_WINDOW), PIC_OBJECTIVE),
        ),
        claims=(Claim("beats", "all negatives", "recent K=256"), Claim("beats", "all negatives", "recent K=64")),
        note="N = 1,438 training scenes, so K = 256 is 18% of N (the paper: 65,536 of 1.28M, 5%).",
    ),
    Ablation(
        name="window",
        title="PIC's sliding window vs epoch order, at equal steps",
        source="PIC",
        published="Visiting instances in overlapping sliding windows, so each is seen again while its "
        "classifier row is fresh, beats a plain shuffled epoch order with recent negatives.",
        variants=(
            Variant("sliding window", (SLIDING_WINDOW,), PIC_OBJECTIVE),
            Variant("epoch order", (EPOCH_ORDER,), PIC_OBJECTIVE),
        ),
        claims=(Claim("beats", "sliding window", "epoch order"),),
    ),
    Ablation(
        name="multicrop",
        title="SwAV: multi-crop vs 2 crops",
        source="SwAV",
        published="Adding small crops (2x224 + 6x96 in the paper) improves SwAV over 2 global crops.",
        variants=(
            Variant("2 + 2 small crops", (SWAV_LR, *MULTI_CROP), SWAV_OBJECTIVE),
            Variant("2 crops", (SWAV_LR,), SWAV_OBJECTIVE),
        ),
        claims=(Claim("beats", "2 + 2 small crops", "2 crops"),),
    ),
    Ablation(
        name="co2",
        title="CO2's consistency term: alpha = 0 vs the default",
        source="CO2",
        published="Adding the consistency term between the two views' similarity distributions (alpha = 0.3 "
        "with MoCo v2) improves over the plain instance loss.",
        variants=(Variant("alpha = 0.3", ("objective.co2_alpha=0.3",)), Variant("alpha = 0")),
        claims=(Claim("beats", "alpha = 0.3", "alpha = 0"),),
    ),
)


def select(names: list[str] | None) -> tuple[Ablation, ...]:
    """The ablations named (all when None), with a clear error for an unknown name."""
    if not names:
        return ABLATIONS
    known = {ablation.name: ablation for ablation in ABLATIONS}
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"--only: unknown ablation(s) {', '.join(unknown)}; choose from {', '.join(known)}")
    return tuple(known[name] for name in names)

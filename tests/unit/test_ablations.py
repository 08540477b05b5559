"""The ablation sweep's pieces that need no training: run configs, the verdicts, the document."""

import statistics
from pathlib import Path

import pytest
import torch
import yaml

from trainer.ablations.catalogue import (
    ABLATIONS,
    MULTI_CROP,
    PIC_OBJECTIVE,
    SWAV_LR,
    SWAV_OBJECTIVE,
    Ablation,
    Claim,
    Variant,
    select,
)
from trainer.ablations.document import Sweep, render, verdicts_of, write
from trainer.ablations.runner import RunResult, SweepSettings, repo_relative, resolved_config, write_checked_config
from trainer.ablations.verdict import NOT_MEASURED, REPRODUCES, REVERSED, WITHIN_NOISE, judge, summarise
from trainer.config import ConfigError, load_job_config
from trainer.drills.jobs import REPO
from trainer.models import ModelConfig, build_model

SETTINGS = SweepSettings(Path("shards/train"), Path("shards/val"), Path("runs"))


def result(variant: str, seed: int, final: float, early: float | None = None, ablation: str = "toy") -> RunResult:
    by_epoch = {12: final} if early is None else {4: early, 12: final}
    return RunResult(ablation, variant, seed, f"{variant}-{seed}", by_epoch, final, 0.2, 12, 100.0, 90.0)


TOY = Ablation("toy", "A toy", "nowhere", "a beats b", (Variant("a"), Variant("b")),
               (Claim("beats", "a", "b"),))


def test_every_shipped_variant_resolves_to_a_valid_config(tmp_path):
    settings = SweepSettings(tmp_path / "train", tmp_path / "val", tmp_path / "runs")
    for ablation in ABLATIONS:
        assert {c.better for c in ablation.claims} | {c.worse for c in ablation.claims} <= {
            v.label for v in ablation.variants}, f"{ablation.name}: a claim names a variant that does not exist"
        for variant in ablation.variants:
            config, _ = resolved_config(settings, variant, 0)
            write_checked_config(config, tmp_path / "c.yaml", ablation, variant)


def test_a_run_config_is_the_demo_with_the_variant_applied_last():
    init = select(["init"])[0]
    gaussian, directory = resolved_config(SETTINGS, init.variant("Gaussian"), seed=3)
    assert gaussian["objective"]["contrastive_prior"] is False
    assert gaussian["seed"] == 3 and gaussian["data"]["loader"]["seed"] == 3
    assert gaussian["logging"]["dir"] == str(directory / "logs") and directory.parent == Path("runs")
    # The sweep's settings apply to every run; the variant's come after them.
    co2 = select(["co2"])[0]
    settings = SweepSettings(
        Path("t"), Path("v"), Path("runs"), overrides=("objective.co2_alpha=0.1", "optim.epochs=1")
    )
    assert resolved_config(settings, co2.variant("alpha = 0.3"), 0)[0]["objective"]["co2_alpha"] == 0.3
    assert resolved_config(settings, co2.variant("alpha = 0"), 0)[0]["objective"]["co2_alpha"] == 0.1
    assert resolved_config(settings, co2.variant("alpha = 0"), 0)[0]["optim"]["epochs"] == 1
    # Another method replaces the demo's objective section wholesale.
    negatives = select(["negatives"])[0]
    pic, _ = resolved_config(SETTINGS, negatives.variant("recent K=64"), 0)
    assert pic["objective"] == dict(PIC_OBJECTIVE, queue_size=64)


def test_a_bad_override_names_the_variant(tmp_path):
    bad = Ablation("bad", "t", "s", "p", (Variant("typo", ("objective.smothing_alpha=0.2",)),), ())
    config, _ = resolved_config(SETTINGS, bad.variants[0], 0)
    with pytest.raises(
        ConfigError,
        match=r"ablation bad, variant 'typo': .*unknown field objective.smothing_alpha; "
        r"did you mean objective.smoothing_alpha",
    ):
        write_checked_config(config, tmp_path / "c.yaml", bad, bad.variants[0])


def test_paths_are_given_to_the_jobs_relative_to_the_checkout(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO / "configs")
    assert repo_relative(Path("../out/ablate")) == Path("out/ablate")  # the jobs run in the checkout
    assert repo_relative(tmp_path / "runs") == tmp_path / "runs"


def test_unknown_ablation_names_the_choices():
    with pytest.raises(ValueError, match="unknown ablation\\(s\\) tabel4; choose from init, head"):
        select(["tabel4"])


def test_identical_variants_share_one_run_and_different_ones_do_not():
    def directory(name, label, seed=0):
        ablation = select([name])[0]
        return resolved_config(SETTINGS, ablation.variant(label), seed)[1]

    # The demo's recipe is the baseline of four ablations: it trains once per seed.
    assert (
        directory("init", "contrastive prior")
        == directory("head", "MLP head")
        == directory("smoothing", "none")
        == directory("co2", "alpha = 0")
    )
    assert directory("init", "contrastive prior", seed=1) != directory("init", "contrastive prior")
    assert directory("negatives", "recent K=256") == directory("window", "sliding window")
    every = [directory(a.name, v.label) for a in ABLATIONS for v in a.variants]
    assert len(set(every)) == len(every) - 4


def test_summary_is_mean_and_sample_std_in_points():
    stats = summarise([0.25, 0.30, 0.32])
    assert stats.mean == pytest.approx(100 * statistics.fmean([0.25, 0.30, 0.32]))
    assert stats.std == pytest.approx(100 * statistics.stdev([0.25, 0.30, 0.32]))
    assert str(summarise([0.5])) == "50.00"


@pytest.mark.parametrize(
    "a,b,outcome",
    [
        ([0.40, 0.42], [0.30, 0.31], REPRODUCES),  # +10.5 points, noise ~0.8
        ([0.40, 0.30], [0.34, 0.35], WITHIN_NOISE),  # +0.5 points, noise ~5
        ([0.30, 0.31], [0.40, 0.42], REVERSED),
    ],
)
def test_beats_counts_only_differences_beyond_the_seeds_noise(a, b, outcome):
    results = [result("a", s, v) for s, v in enumerate(a)] + [result("b", s, v) for s, v in enumerate(b)]
    verdict = judge(TOY.claims[0], TOY, results)
    assert verdict.outcome == outcome
    expected_noise = (
        statistics.variance([100 * v for v in a]) / 2 + statistics.variance([100 * v for v in b]) / 2
    ) ** 0.5
    assert verdict.noise == pytest.approx(expected_noise)
    assert verdict.difference == pytest.approx(100 * (sum(a) - sum(b)) / 2)


def test_at_least_as_good_allows_a_loss_within_noise():
    claim = Claim("at_least", "a", "b")
    within = [result("a", 0, 0.30), result("a", 1, 0.36), result("b", 0, 0.34), result("b", 1, 0.34)]
    assert judge(claim, TOY, within).outcome == REPRODUCES
    clear_loss = [result("a", 0, 0.20), result("a", 1, 0.21), result("b", 0, 0.34), result("b", 1, 0.34)]
    assert judge(claim, TOY, clear_loss).outcome == REVERSED


def test_gap_shrinks_compares_the_early_and_the_final_gap():
    claim = Claim("gap_shrinks", "a", "b", epoch=4)
    shrinking = [result("a", s, 0.40, early=0.30) for s in range(2)] + [
        result("b", s, 0.39, early=0.20) for s in range(2)
    ]
    verdict = judge(claim, TOY, shrinking)
    assert verdict.outcome == REPRODUCES and verdict.difference == pytest.approx(9.0)
    growing = [result("a", s, 0.45, early=0.21) for s in range(2)] + [
        result("b", s, 0.30, early=0.20) for s in range(2)
    ]
    assert judge(claim, TOY, growing).outcome == REVERSED
    no_early = [result("a", 0, 0.4), result("b", 0, 0.3)]
    assert judge(claim, TOY, no_early).outcome == NOT_MEASURED


def test_document_reports_every_variant_and_verdict(tmp_path):
    results = [result("a", s, 0.40 + s / 100, early=0.3) for s in range(2)] + [
        result("b", s, 0.30, early=0.3) for s in range(2)
    ]
    sweep = Sweep(SETTINGS, (TOY,), results, "instcls ablate --only toy --seeds 2")
    (verdict,) = verdicts_of(sweep)["toy"]
    assert verdict.outcome == REPRODUCES and verdict.claim == TOY.claims[0]
    assert (verdict.difference, verdict.noise) == pytest.approx((10.5, 0.5))
    # The one test of the document's text: every variant's row and every verdict's fields in its row.
    text = render(sweep, "toy.png")
    assert "| a | 30.00 ± 0.00 | 40.50 ± 0.71 | 100 | 90 |" in text
    (row,) = [line for line in text.splitlines() if line.startswith(f"| {TOY.name} |")]
    for field in (TOY.source, verdict.claim.describe(), f"{verdict.difference:+.2f} ± {verdict.noise:.2f}",
                  verdict.outcome):
        assert field in row, (field, row)
    assert str(summarise([r.knn_random_init for r in results])) in text
    markdown, png = write(sweep, tmp_path / "docs" / "toy.md")
    assert markdown.read_text(encoding="utf-8") == text and png.stat().st_size > 10_000


def test_linear_head_is_one_layer_to_the_feature_width():
    model = build_model(ModelConfig(arch="resnet10", head="linear", feature_dim=16))
    assert isinstance(model.head, torch.nn.Linear) and model.head.out_features == 16
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 16)
    mlp = build_model(ModelConfig(arch="resnet10", head_hidden_dim=32, feature_dim=16))
    assert len(mlp.head) == 4


def test_demo_config_is_the_base_of_every_run():
    config = load_job_config(SETTINGS.base_config)
    assert config.objective.name == "instance" and config.model.head == "mlp"


def test_pic_and_swav_ablations_measure_the_shipped_demo_configs_objectives():
    pic = yaml.safe_load((REPO / "configs" / "pic_demo_cpu.yaml").read_text())
    swav = yaml.safe_load((REPO / "configs" / "swav_demo_cpu.yaml").read_text())
    assert pic["objective"] == PIC_OBJECTIVE and swav["objective"] == SWAV_OBJECTIVE
    assert SWAV_LR == f"optim.base_lr={swav['optim']['base_lr']}"
    assert f"data.loader.augment.small_crops={swav['data']['loader']['augment']['small_crops']}" in MULTI_CROP

"""The memory planner's arithmetic and its answers to "does it fit?"."""

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from trainer.objectives.memory_plan import ClassifierRows, SampledRows
from trainer.planning import (
    GIB,
    PlanInput,
    format_plan,
    largest_classes,
    objective_breakdown,
    plan_modes,
    predict,
    total,
)


def planned(tmp_path, *args: str) -> dict:
    """`instcls plan ARGS`, as the per-mode plan its --json writes."""
    from trainer.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", *args, "--json", str(path)]) == 0
    return json.loads(path.read_text())


def test_sharding_divides_the_classifier_state_by_the_ranks():
    ddp = objective_breakdown(PlanInput(mode="ddp", num_classes=1_000_000, ranks=8, batch=256))
    dhp = objective_breakdown(PlanInput(mode="dhp", num_classes=1_000_000, ranks=8, batch=256))
    assert ddp["classifier weights"] == 1_000_000 * 128 * 4
    assert dhp["classifier weights"] == 125_000 * 128 * 4
    assert ddp["classifier momentum"] == ddp["classifier gradients"] == ddp["classifier weights"]


def test_update_in_backward_drops_the_gradient():
    plan = PlanInput(mode="dhp", num_classes=14_197_122, ranks=2, batch=256, device="cpu", update_in_backward=True)
    assert predict(plan)["classifier gradients"] == 0
    with pytest.raises(ValueError, match="dhp only"):
        PlanInput(mode="ddp", num_classes=10, ranks=2, update_in_backward=True)


def test_largest_classes_is_the_fitting_boundary():
    plan = PlanInput(mode="dhp", num_classes=1, ranks=4, batch=256, device="cpu")
    capacity = 3 * GIB
    largest = largest_classes(plan, capacity)
    assert total(plan.__class__(**{**plan.__dict__, "num_classes": largest})) <= capacity
    assert total(plan.__class__(**{**plan.__dict__, "num_classes": int(largest * 1.01)})) > capacity
    ddp_largest = largest_classes(plan.__class__(**{**plan.__dict__, "mode": "ddp"}), capacity)
    assert 3.6 < largest / ddp_largest <= 4.0


def test_backbone_terms_follow_zero_partitioning():
    base = dict(mode="dhp", num_classes=1_281_167, ranks=64, batch=4096, backbone="resnet50", dtype="bfloat16")
    stage0, stage3 = predict(PlanInput(**base, zero_stage=0)), predict(PlanInput(**base, zero_stage=3))
    assert stage3["backbone weights"] * 64 == pytest.approx(stage0["backbone weights"], rel=1e-6)
    assert 70 * 2**20 < predict(PlanInput(**{**base, "dtype": "float32"}))["backbone activations"] / 128 < 95 * 2**20


def test_report_says_whether_each_mode_fits():
    plan = PlanInput(mode="dhp", num_classes=14_197_122, ranks=2, batch=256, device="cpu")
    modes = plan_modes(plan, 12 * GIB)
    assert modes["ddp"]["total_bytes"] == total(replace(plan, mode="ddp")) > 12 * GIB and not modes["ddp"]["fits"]
    assert modes["dhp"]["total_bytes"] == total(plan) <= 12 * GIB and modes["dhp"]["fits"]
    # The printed plan is these figures, one block per mode (the one test of format_plan's text).
    blocks = re.split(r"\n(?! )", format_plan(plan, 12 * GIB))
    assert len(blocks) == len(modes)
    for block, (mode, figures) in zip(blocks, modes.items()):
        assert f"{plan.num_classes:,}" in block and f"{figures['total_bytes'] / GIB:.2f} GiB" in block, mode
        for name, value in figures["breakdown"].items():
            assert re.search(rf"{re.escape(name)} +{value / GIB:.3f} GiB", block), (mode, name)
        assert figures["largest_classes"] is None or f"{figures['largest_classes']:,}" in block, mode


def test_logits_cache_is_planned_only_when_it_fits_its_budget():
    plan = dict(num_classes=1_000_000, ranks=2, batch=256, views=1, device="cpu")
    cache = 256 * 500_000 * 4  # DHP: the gathered batch times the shard, fp32
    assert predict(PlanInput(mode="dhp", **plan))["logits cache"] == 0
    assert predict(PlanInput(mode="dhp", logits_cache_bytes=cache, **plan))["logits cache"] == cache
    assert predict(PlanInput(mode="dhp", logits_cache_bytes=cache - 1, **plan))["logits cache"] == 0
    # DDP scores its local half of the batch against all N classes: the same number of logits.
    assert predict(PlanInput(mode="ddp", logits_cache_bytes=cache, **plan))["logits cache"] == cache


def test_plan_command_reports_the_cache(tmp_path):
    args = "--num-classes 1000000 --ranks 2 --batch 256 --views 1 --cpu --logits-cache-gib 1"
    modes = planned(tmp_path, *args.split())
    cache = 256 * 500_000 * 4
    assert {mode: p["breakdown"].get("logits cache") for mode, p in modes.items()} == {"ddp": cache, "dhp": cache,
                                                                                      "pic": None}


def test_pic_rows_off_the_device_make_device_memory_independent_of_n():
    small = PlanInput(mode="pic", num_classes=1_281_167, ranks=8, batch=512, device="cpu")
    large = PlanInput(mode="pic", num_classes=50_000_000, ranks=8, batch=512, device="cpu")
    assert total(small) == total(large)
    assert predict(large)["sampled rows (W, momentum, gradient)"] == 3 * ((65536 + 512) // 8) * 128 * 4
    on_device = PlanInput(mode="pic", num_classes=50_000_000, ranks=8, batch=512, device="cpu", row_store="device")
    assert predict(on_device)["classifier weights"] == 6_250_000 * 128 * 4
    full = PlanInput(mode="dhp", num_classes=50_000_000, ranks=8, batch=512, device="cpu")
    assert total(full) > 3 * total(on_device) / 2 > total(large)
    assert plan_modes(large, 16 * GIB)["pic"]["largest_classes"] is None  # any N fits


@pytest.mark.parametrize("cached", [False, pytest.param(True, marks=pytest.mark.slow)])
@pytest.mark.integration
def test_co2_term_adds_no_workspace_buffers_and_plans_one_block(monkeypatch, cached):
    """Counts the chunk buffers the real kernel allocates with and without the term: the fused term
    reuses the kernel's buffers, so its only chunk memory is the fresh [chunk, columns] block its
    inductor-compiled backward writes (the same code on every device)."""
    import torch

    from data_pipeline.loading.view_layout import ViewLayout
    from trainer.classifier import ClassifierConfig, ShardedCosineClassifier
    from trainer.classifier.kernel.chunk_workspace import ChunkWorkspace
    from trainer.parallel.dims import single_process_dims

    num_classes, batch, chunk = 300, 8, 64
    allocated: list[int] = []
    original = ChunkWorkspace._buffer

    def counting(self, name, per_row):
        if name not in self._lazy:
            allocated.append(self._chunk_rows * per_row * 4)
        return original(self, name, per_row)

    monkeypatch.setattr(ChunkWorkspace, "_buffer", counting)
    cache_bytes = 1 << 30 if cached else 0

    def workspace_bytes(alpha):
        allocated.clear()
        classifier = ShardedCosineClassifier(
            ClassifierConfig(num_classes=num_classes, feature_dim=16, chunk_size=chunk, co2_alpha=alpha,
                             logits_cache_bytes=cache_bytes), single_process_dims(),
            ViewLayout(("global", "global"), (32, 32)))
        features = torch.randn(2 * batch, 16, requires_grad=True)
        classifier(features, torch.arange(batch).repeat(2)).backward()
        return sum(allocated)

    assert workspace_bytes(0.3) == workspace_bytes(0.0) > 0
    plan = PlanInput(mode="dhp", num_classes=num_classes, ranks=1, batch=batch, dim=16, chunk_size=chunk,
                     logits_cache_bytes=cache_bytes, device="cpu", co2=True)
    for device in ("cpu", "gpu"):
        assert predict(replace(plan, device=device))["CO2 term (chunk scratch)"] == 2 * batch * chunk * 4
    assert predict(replace(plan, device="gpu", co2=False))["CO2 term (chunk scratch)"] == 0


def test_a_gpu_plan_counts_zero_buckets_and_dali_buffers():
    """What DeepSpeed and DALI hold on the device besides the model."""
    from trainer.planning.plan_input import DEEPSPEED_REDUCE_BUCKET

    base = dict(mode="dhp", num_classes=1_000_000, ranks=8, batch=1024, backbone="resnet50", dtype="bfloat16")
    stage2 = predict(PlanInput(**base, zero_stage=2))
    assert stage2["ZeRO gradient buckets"] == DEEPSPEED_REDUCE_BUCKET * 2  # bf16 elements
    assert predict(PlanInput(**base, zero_stage=2, overlap_comm=True))["ZeRO gradient buckets"] == \
        2 * DEEPSPEED_REDUCE_BUCKET * 2
    assert predict(PlanInput(**base, zero_stage=1, reduce_bucket=50_000_000))["ZeRO gradient buckets"] == 10**8
    for no_buckets in (dict(zero_stage=0), dict(zero_stage=2, device="cpu")):  # (ZeRO-3: its own test)
        assert "ZeRO gradient buckets" not in predict(PlanInput(**base, **no_buckets))
    # 128 local images x 2 views of float32 3x224x224, two batches ahead, plus the decoded images.
    assert stage2["DALI pipeline buffers"] == 2 * 128 * 2 * 3 * 224 * 224 * 4 + 128 * 500 * 400 * 3
    assert "DALI pipeline buffers" not in predict(PlanInput(**base, zero_stage=2, dali=False))
    # data.loader.prefetch_depth: each batch more ahead is one more batch of views on the device
    deeper = predict(PlanInput(**base, zero_stage=2, dali_prefetch=3))
    assert deeper["DALI pipeline buffers"] - stage2["DALI pipeline buffers"] == 128 * 2 * 3 * 224 * 224 * 4


def test_the_plan_reads_zero_settings_from_a_deepspeed_config():
    from trainer.engine.deepspeed_setup import load_deepspeed_config
    from trainer.planning import deepspeed_settings

    assert deepspeed_settings(load_deepspeed_config(Path("ds_configs/zero2_bf16.json"), 1)) == {
        "zero_stage": 2, "reduce_bucket": 50_000_000, "overlap_comm": False, "prefetch_bucket": 50_000_000,
        "fp32_gradients": True, "fp32_weights": False, "dtype": "bfloat16"}
    assert deepspeed_settings({"zero_optimization": {"stage": 1, "overlap_comm": True}}) == {
        "zero_stage": 1, "reduce_bucket": 500_000_000, "overlap_comm": True, "prefetch_bucket": 50_000_000,
        "fp32_gradients": False, "fp32_weights": False, "dtype": "float32"}


def test_bf16_under_autocast_is_planned_with_fp32_weights_gradients_and_no_master_copy():
    """ds_configs/zero0_autocast_bf16.json: bf16 activations and features, but the weights are fp32
    (they are the masters) and so are the gradients: 4 + 4 bytes per parameter plus the optimizer's
    state, where a bf16 engine holds 2 + 4 (fp32 gradients) + 4 (master) plus the state."""
    from trainer.engine.deepspeed_setup import load_deepspeed_config
    from trainer.planning import backbone_breakdown, deepspeed_settings

    autocast = deepspeed_settings(load_deepspeed_config(Path("ds_configs/zero0_autocast_bf16.json"), 1))
    assert autocast == {"zero_stage": 0, "reduce_bucket": 500_000_000, "overlap_comm": False,
                        "prefetch_bucket": 50_000_000, "fp32_gradients": True, "fp32_weights": True,
                        "dtype": "bfloat16"}
    common = dict(mode="dhp", num_classes=1000, ranks=2, batch=8, backbone="resnet18", optimizer="sgd")
    planned = backbone_breakdown(PlanInput(**common, **autocast))
    engine = backbone_breakdown(PlanInput(**common, **{**autocast, "fp32_weights": False}))
    parameters = planned["backbone weights"] // 4
    assert planned["backbone gradients"] == engine["backbone gradients"] == 4 * parameters
    assert (planned["backbone weights"], engine["backbone weights"]) == (4 * parameters, 2 * parameters)
    assert (planned["backbone optimizer state"], engine["backbone optimizer state"]) == (4 * parameters,
                                                                                         8 * parameters)
    assert planned["backbone activations"] == engine["backbone activations"]  # bf16 either way


def test_zero3_buckets_and_fp32_gradients_are_planned():
    """ZeRO-3's reduce and prefetch buckets are counted; fp32 gradients of a bf16 backbone cost 4
    bytes per (partitioned) parameter and per bucket element."""
    from trainer.engine.deepspeed_setup import load_deepspeed_config
    from trainer.planning import backbone_breakdown, deepspeed_settings, runtime_breakdown

    settings = deepspeed_settings(load_deepspeed_config(Path("ds_configs/zero3_bf16.json"), 1))
    plan = PlanInput(mode="dhp", num_classes=1000, ranks=4, batch=64, backbone="resnet18", image_size=32, **settings)
    runtime = runtime_breakdown(plan)
    assert runtime["ZeRO gradient buckets"] == 50_000_000 * 4
    assert runtime["ZeRO-3 parameter prefetch bucket"] == 50_000_000 * 2
    bf16_gradients = backbone_breakdown(PlanInput(**{**plan.__dict__, "fp32_gradients": False}))
    assert backbone_breakdown(plan)["backbone gradients"] == 2 * bf16_gradients["backbone gradients"]


def test_a_config_is_planned_as_the_job_it_describes(tmp_path, capsys):
    from trainer.config import load_job_config
    from trainer.planning.plan_from_config import plan_input_from_config

    repo = Path(__file__).resolve().parents[2]
    plan = plan_input_from_config(load_job_config(repo / "configs/in1k_r50_64gpu.yaml", []), 64, 1_281_167)
    assert (plan.mode, plan.num_classes, plan.ranks, plan.batch, plan.dim, plan.backbone, plan.image_size,
            plan.views, plan.zero_stage, plan.dtype, plan.dali, plan.device) == (
        "dhp", 1_281_167, 64, 64 * 64, 128, "resnet50", 224, 2, 0, "bfloat16", True, "gpu")
    assert plan.fp32_weights and plan.fp32_gradients  # bf16 through autocast
    assert plan.objective == ClassifierRows(sharded=True, hard_negatives=100)
    pic = plan_input_from_config(load_job_config(repo / "configs/pic_in1k_r50.yaml", []), 8, 1000)
    assert (pic.mode, pic.objective) == ("pic", SampledRows(queue_size=65536, row_store="host"))
    modes = planned(tmp_path, "--config", str(repo / "configs/in1k_r50_64gpu.yaml"), "--ranks", "64",
                    "--num-classes", "1000", "--cpu")  # --cpu holds with --config too: no CUDA context is counted
    assert not [name for p in modes.values() for name in p["breakdown"] if "CUDA context" in name]
    missing = load_job_config(repo / "configs/in1k_r50_64gpu.yaml", [f"data.train_shards={tmp_path}"])
    with pytest.raises(ValueError, match=f"data.train_shards={tmp_path} has no manifest.json .* --num-classes N"):
        plan_input_from_config(missing, 64, None)


def test_the_plan_counts_the_backbone_by_default_and_refuses_bad_numbers(tmp_path, capsys):
    from trainer.cli import main

    modes = planned(tmp_path, "--num-classes", "1000", "--ranks", "2")
    assert all(p["breakdown"]["backbone activations"] > 0 for p in modes.values())
    modes = planned(tmp_path, "--num-classes", "1000", "--ranks", "2", "--backbone", "none")
    assert not [name for p in modes.values() for name in p["breakdown"] if "backbone" in name]
    capsys.readouterr()  # the plans printed
    for flag, value in [("--num-classes", "-5"), ("--ranks", "0"), ("--gpu-memory-gib", "0"), ("--batch", "x")]:
        with pytest.raises(SystemExit):
            main(["plan", "--num-classes", "1000", "--ranks", "2", flag, value])
        assert f"argument {flag}: " in capsys.readouterr().err


def test_a_gpu_plan_without_a_term_runs_the_fused_kernels_and_holds_no_logits():
    """On GPUs the classifier runs the fused Triton kernels: no chunk workspace and no
    logits cache, only their per-sample buffers; CO2 and CPUs keep the chunked workspace."""
    plan = PlanInput(mode="dhp", num_classes=14_197_122, ranks=64, batch=4096, dtype="bfloat16",
                     logits_cache_bytes=64 * GIB, targets=101)
    fused = objective_breakdown(plan)
    assert plan.fused and fused["logits/activations (chunk workspace)"] == 0 and fused["logits cache"] == 0
    assert 0 < fused["fused kernel buffers"] < 0.2 * GIB  # 133 MiB, 101 target rows gathered 8 at a time
    for chunked_plan in (replace(plan, co2=True), replace(plan, device="cpu"), replace(plan, kernel="chunked")):
        chunked = objective_breakdown(chunked_plan)
        assert not chunked_plan.fused and chunked["fused kernel buffers"] == 0
        assert chunked["logits/activations (chunk workspace)"] > 10 * fused["fused kernel buffers"]


def test_plan_flags_with_a_config_are_applied_as_its_overrides_or_refused(tmp_path, capsys):
    """With --config a job flag used to be ignored in silence (the config's batch was planned); now it
    is the override it stands for, printed, and gives the same plan as that override; a flag no one
    override says is refused naming what to give; --set needs a config."""
    from trainer.cli import main

    config = str(Path(__file__).resolve().parents[2] / "configs/in1k_r50_64gpu.yaml")
    common = ["--config", config, "--ranks", "64", "--num-classes", "1281167"]
    shipped = planned(tmp_path, *common)["dhp"]
    by_flags = planned(tmp_path, *common, "--batch", "8192", "--dim", "256")["dhp"]
    assert "with --set data.loader.batch_size=128 --set model.feature_dim=256" in capsys.readouterr().out
    by_set = planned(tmp_path, *common, "--set", "data.loader.batch_size=128", "--set", "model.feature_dim=256")["dhp"]
    assert by_flags == by_set != shipped
    assert by_flags["breakdown"]["classifier weights"] == 2 * shipped["breakdown"]["classifier weights"]  # D doubled
    for flags, fix in [(["--zero-stage", "2"], "--set deepspeed_config="), (["--co2"], "--set objective.co2_alpha="),
                       (["--batch", "100"], "64 ranks do not divide it")]:
        with pytest.raises(SystemExit, match=re.escape(fix)):
            main(["plan", *common, *flags])
    with pytest.raises(SystemExit, match="give the config with --config FILE"):
        main(["plan", "--num-classes", "1000", "--ranks", "2", "--set", "optim.epochs=3"])


def _numeric_options(parser, command: str) -> list[str]:
    """The options of ``command`` whose values are numbers (their type turns "1" into an int or float)."""
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    found = []
    for action in subcommands[command]._actions:
        if not action.option_strings or action.type is None:
            continue
        try:
            value = action.type("1")
        except Exception:
            continue
        if isinstance(value, (int, float)):
            found.append(action.option_strings[0])
    return found


IN1K = "configs/in1k_r50_64gpu.yaml"
PIC = "configs/pic_in1k_r50.yaml"
# What `instcls plan --config FILE FLAG 0` does for each numeric flag: ("override", config, flags that make the
# config differ from what 0 says, the --set it stands for); ("refused", the same flag's other value, refused
# alike); ("below minimum", the minimum argparse names).
ZERO_WITH_A_CONFIG = {
    "--logits-cache-gib": ("override", IN1K,
                           ["--kernel", "chunked", "--set", "objective.logits_cache_bytes=1073741824"],
                           "objective.logits_cache_bytes=0"),
    "--queue": ("override", PIC, [], "objective.queue_size=0"),
    "--top-k": ("override", IN1K, [], "objective.smoothing_alpha=0"),  # no hard negatives: the smoothing off
    "--zero-stage": ("refused", "2"),
    "--gpu-memory-gib": ("below minimum", "> 0"),
    "--eval-images-per-second": ("below minimum", "> 0"),
    **{flag: ("below minimum", ">= 1") for flag in ("--num-classes", "--ranks", "--batch", "--views", "--dim",
                                                     "--chunk-size", "--image-size", "--patch-size")},
}


def test_zero_given_to_any_numeric_plan_flag_with_a_config_is_honoured_or_refused_as_its_other_values(
        tmp_path, capsys):
    """0 == False, and a flag given as 0 was taken for one not given: with --config, --logits-cache-gib 0,
    --queue 0 and --top-k 0 were dropped in silence (the config's cache, queue and hard negatives were
    planned) and --zero-stage 0 went through where every other stage is refused.  Each numeric flag is
    given 0 here; a new one must say in the table above what 0 does."""
    from trainer.cli import build_parser, main

    assert sorted(_numeric_options(build_parser(), "plan")) == sorted(ZERO_WITH_A_CONFIG)
    common = ["--ranks", "64", "--num-classes", "1281167"]

    def refusal(*args: str) -> str:
        with pytest.raises(SystemExit) as raised:
            main(["plan", "--config", IN1K, *common, *args])
        return f"{raised.value.code} {capsys.readouterr().err}"

    for flag, (outcome, *expected) in ZERO_WITH_A_CONFIG.items():
        if outcome == "below minimum":
            assert f"argument {flag}: 0 is invalid: use a number {expected[0]}" in refusal(flag, "0"), flag
        elif outcome == "refused":
            assert refusal(flag, "0") == refusal(flag, expected[0]), flag
        else:
            config, making_it_differ, override = expected
            plan_args = ["--config", config, *common, *making_it_differ]
            config_plan = planned(tmp_path, *plan_args)
            by_flag = planned(tmp_path, *plan_args, flag, "0")
            printed = next(line for line in capsys.readouterr().out.splitlines()[::-1] if line.startswith("config:"))
            assert f"--set {override} " in printed + " ", flag  # the last plan's config line
            by_set = planned(tmp_path, *plan_args, "--set", override)
            assert by_flag == by_set != config_plan, flag
    # What each override plans, from the plan's own terms: no logits cache, no hard-negative rows, and
    # PIC's sampled rows (W, momentum, gradient: 3 x D fp32) only the local batch's 2048 / 64 images.
    cache = planned(tmp_path, "--config", IN1K, *common, *ZERO_WITH_A_CONFIG["--logits-cache-gib"][2])["dhp"]
    assert cache["breakdown"]["logits cache"] > 0
    assert planned(tmp_path, "--config", IN1K, *common, *ZERO_WITH_A_CONFIG["--logits-cache-gib"][2],
                   "--logits-cache-gib", "0")["dhp"]["breakdown"]["logits cache"] == 0
    assert planned(tmp_path, "--config", IN1K, *common, "--top-k", "0")["dhp"]["breakdown"][
        "top-K smoothing (hard negatives, targets)"] == 0
    rows = planned(tmp_path, "--config", PIC, *common, "--queue", "0")["pic"]["breakdown"]
    assert rows["sampled rows (W, momentum, gradient)"] == 2048 // 64 * 3 * 128 * 4

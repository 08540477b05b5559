"""The first start of an elastic launch checks, on each GPU rank, that the job fits at the smallest
size of its range, where the kept global batch gives every rank the most images: 105 per GPU at 64
ranks is 210 at 32.  The estimate is the planner's own (`instcls plan`'s) at the smallest size; no
GPU is needed here, the device's free memory is stubbed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainer.config import load_job_config
from trainer.engine.resumed_settings import settings_for_this_run
from trainer.parallel.elastic_range import WORLD_SIZES_ENV
from trainer.planning import GIB
from trainer.planning.plan_from_config import plan_input_from_config
from trainer.planning.prediction import total

CONFIG = Path(__file__).resolve().parents[2] / "configs/in1k_r50_64gpu.yaml"
IN1K = 1_281_167
SIZES = "32,40,48,56,64"  # --nnodes 4:8 --nproc-per-node 8
GPU = torch.device("cuda", 0)
CAPACITY = 80 * GIB


def _planned(batch_size: int, ranks: int) -> int:
    """The planner's peak per rank for the shipped ImageNet job at ``batch_size`` per rank on ``ranks``."""
    config = load_job_config(CONFIG, [f"data.loader.batch_size={batch_size}"])
    return total(plan_input_from_config(config, ranks, IN1K))


@pytest.fixture
def gpu_with_free(monkeypatch):
    """A rank on cuda:0 of an 80 GiB GPU whose free memory the test sets, in an elastic launch."""
    monkeypatch.setenv(WORLD_SIZES_ENV, SIZES)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    free = {}

    def mem_get_info(device):
        assert device == GPU
        return free["bytes"], CAPACITY

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return free


def _start(overrides=(), world_size=64, device=GPU, resumed=None, meta=None):
    config = load_job_config(CONFIG, ["data.loader.batch_size=105", *overrides])
    return settings_for_this_run(config, world_size, resumed, meta, device, IN1K)


def test_a_job_that_fits_at_the_largest_size_but_not_the_smallest_is_refused(gpu_with_free):
    at_largest, at_smallest = _planned(105, 64), _planned(210, 32)
    margin = int(0.1 * CAPACITY)  # parallel.elastic.memory_margin's default
    assert at_largest < at_smallest  # twice the images per rank, twice the classifier rows
    gpu_with_free["bytes"] = at_smallest + margin - 1  # one byte short of the planner's peak at 32 ranks
    assert at_largest + margin < gpu_with_free["bytes"]
    with pytest.raises(ValueError, match="elastic range of this launch") as refused:
        _start()
    message = str(refused.value)
    assert "32 ranks x 210 images" in message and "the global batch 6720" in message
    assert f"is {at_smallest / GIB:.2f} GiB" in message
    assert f"{gpu_with_free['bytes'] / GIB:.2f} GiB free of 80.00 GiB" in message
    assert "smaller data.loader.batch_size" in message and "larger MIN in --nnodes MIN:MAX" in message
    assert "parallel.elastic.memory_check=false" in message
    assert "instcls plan --config CONFIG --ranks 32 --set data.loader.batch_size=210" in message

    gpu_with_free["bytes"] = at_smallest + margin  # exactly enough: the planner's peak plus the margin
    settings = _start()
    assert any(note.startswith("elastic memory check: fits") for note in settings.notes)
    gpu_with_free["bytes"] = at_smallest  # no room for the margin, unless the job asks for none
    with pytest.raises(ValueError, match=r"parallel.elastic.memory_margin=0.1\)"):
        _start()
    _start(["parallel.elastic.memory_margin=0"])


def test_the_check_turned_off_starts_the_same_job(gpu_with_free):
    gpu_with_free["bytes"] = 1 * GIB
    with pytest.raises(ValueError, match="parallel.elastic.memory_check=false"):
        _start()
    settings = _start(["parallel.elastic.memory_check=false"])
    assert settings.split.per_rank == 105
    assert not any("elastic memory check" in note for note in settings.notes)


def test_a_restart_is_not_checked_again(gpu_with_free, tmp_path):
    """A resume keeps the global batch the first start checked; its GPU may still be freeing the
    previous run's memory."""
    gpu_with_free["bytes"] = 1 * GIB
    settings = _start(world_size=32, resumed=tmp_path, meta={"global_batch": 6720, "world_size": 64})
    assert settings.split.per_rank == 210


def test_a_cpu_rank_skips_the_check_with_one_line(monkeypatch):
    monkeypatch.setenv(WORLD_SIZES_ENV, SIZES)

    def no_gpu(device):
        raise AssertionError("a CPU rank has no GPU memory to read")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_gpu)
    settings = _start(device=torch.device("cpu"))
    skipped = [note for note in settings.notes if "elastic memory check" in note]
    assert skipped == ["elastic memory check skipped: this rank runs on cpu, not a GPU (the check compares the "
                       "planned peak at 32 ranks with a GPU's free memory)"]

"""Every process group the project creates names its timeout: ``new_group`` without one gives a gloo
group 30 minutes, whatever the job's own (``init_distributed(timeout_s=...)``)."""

from __future__ import annotations

import ast
import datetime
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.checkpoint.async_checkpoint import WRITER_TIMEOUT, AsyncCheckpointer
from trainer.parallel import init_distributed
from trainer.parallel.dims import ParallelDims

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def created_groups(monkeypatch) -> list[dict]:
    """``dist.new_group``'s keyword arguments, call by call; no group is made."""
    calls: list[dict] = []
    monkeypatch.setattr(dist, "new_group", lambda *args, **kwargs: calls.append(kwargs) or object())
    return calls


def test_the_layouts_groups_get_the_jobs_timeout(monkeypatch, created_groups):
    """8 NCCL ranks, classifier groups of 4: two classifier groups, four replica groups, the control group."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # as if torchrun's job were joined
    for name, value in dict(WORLD_SIZE="8", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="8", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT="29500").items():
        monkeypatch.setenv(name, value)
    init_distributed(classifier_parallel_size=4, backend="nccl", timeout_s=42, device="cpu")
    assert len(created_groups) == 2 + 4 + 1
    assert all(call.get("timeout") == datetime.timedelta(seconds=42) for call in created_groups), created_groups
    assert created_groups[-1]["backend"] == "gloo"  # the control group


def test_the_checkpoint_writers_group_waits_for_the_slowest_rank_as_long_as_it_says(tmp_path, created_groups):
    dims = ParallelDims(world_size=2, rank=0, local_rank=0, classifier_parallel_size=2, device=torch.device("cpu"),
                        backend="gloo")
    AsyncCheckpointer(tmp_path, dims, keep_last=1).close()
    assert created_groups == [{"backend": "gloo", "timeout": WRITER_TIMEOUT}]


def test_every_new_group_call_in_the_code_names_its_timeout():
    untimed = []
    for package in ("trainer", "data_pipeline"):
        for path in sorted((REPO / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr in ("new_group", "new_subgroups")
                        and "timeout" not in {keyword.arg for keyword in node.keywords}):
                    untimed.append(f"{path.relative_to(REPO)}:{node.lineno}")
    assert not untimed, f"new_group without timeout= (it would wait 30 minutes): {untimed}"

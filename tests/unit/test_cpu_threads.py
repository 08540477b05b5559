"""Locally spawned CPU ranks share the cores the process may use, whatever the host has."""

import os

import pytest

from trainer.parallel import launch


@pytest.mark.parametrize("cpu_max, affinity, cores", [
    ("max 100000\n", 8, 8),  # no quota: the cpuset decides
    ("200000 100000\n", 64, 2),  # `docker --cpus 2` on a 64-core host
    ("150000 100000\n", 64, 2),  # 1.5 CPUs: rounded up
    ("50000 100000\n", 64, 1),  # half a CPU: still one
    ("800000 100000\n", 4, 4),  # a quota above the cpuset
    (None, 6, 6),  # no cgroup v2 file (cgroup v1, or not Linux containers)
])
def test_usable_cores_take_the_cpuset_and_the_cgroup_quota(monkeypatch, tmp_path, cpu_max, affinity, cores):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    assert launch.usable_cores(path) == cores


def test_threads_per_rank_follow_omp_num_threads_else_an_equal_share(monkeypatch):
    monkeypatch.setattr(launch, "usable_cores", lambda: 8)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert [launch.cpu_threads_per_rank(ranks) for ranks in (1, 2, 3, 16)] == [8, 4, 2, 1]
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch.cpu_threads_per_rank(2) == 3

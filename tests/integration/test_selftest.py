"""`instcls selftest`: its CPU subset passes here and in CI and names what it skipped (by default
over the rows chosen with ``--only`` below, every CPU row in the slow run); a failing check fails
the command; on a GPU node (marker ``gpu``) every check must run and pass.  Nothing
passes vacuously: each of these fails the command (a GPU node whose CUDA cannot start, a check
failing on rank 1 only, a rank raising while the others wait in a collective, PIC's store wrong
but finite, a host sync in the smoothing/CO2 step), and the GPU step must run the DeepSpeed config
the shipped GPU jobs run."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from trainer.selftest.report import FAIL, PASS, SKIPPED, CheckResult

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
GPU_ONLY = {"in1k job step"}
EVERY_CHECK = {"devices", "compiled CO2 kernel", "PIC host store + prefetch", "DALI decode", "collectives",
               "sharded classifier", "host syncs per step"} | GPU_ONLY
# The CPU rows whose checks no other default-suite test runs whole and unplanted, and the GPU-only row.
# The others' code is run there: the compiled CO2 kernel against eager by tests/unit/test_co2_kernel.py,
# DALI's CPU decode by tests/integration/test_loaders.py, the host-sync count on fake devices, whole, by
# test_a_host_sync_in_the_smoothing_and_co2_step_fails_the_check below.
CHOSEN = ["devices", "PIC host store + prefetch", "collectives", "sharded classifier", "in1k job step"]


def test_the_chosen_cpu_rows_pass_and_the_gpu_only_row_says_it_was_skipped(tmp_path, capsys):
    from trainer.cli import main

    out = tmp_path / "selftest.json"
    assert main(["selftest", "--json", str(out), *[arg for name in CHOSEN for arg in ("--only", name)]]) == 0, \
        capsys.readouterr().out[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())}
    assert list(rows) == CHOSEN  # the rows asked for, in the order of the full run, and no other
    for name, row in rows.items():
        if name in GPU_ONLY:
            assert row["status"] == SKIPPED and "CUDA" in row["detail"], row
        else:
            assert row["status"] == PASS, row
    # The printed table lists the rows run and no other (their cells: test_a_failing_check_fails_the_command).
    table = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0].strip() for line in table if line.split("  ")[0].strip() in EVERY_CHECK] == CHOSEN


def test_only_refuses_a_name_that_is_no_check(capsys):
    from trainer.cli import main

    assert main(["selftest", "--only", "colectives"]) == 2
    error = capsys.readouterr().err
    assert "--only 'colectives': no such check" in error and all(f"'{name}'" in error for name in EVERY_CHECK)


@pytest.mark.slow  # default suite: the chosen rows above, and each other row's code in the tests named by CHOSEN
def test_the_cpu_subset_passes_and_says_what_it_skipped(tmp_path):
    out = tmp_path / "selftest.json"
    result = subprocess.run([sys.executable, "-m", "trainer.cli", "selftest", "--json", str(out)], cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = {row["name"]: row for row in json.loads(out.read_text())}
    assert set(rows) == EVERY_CHECK
    for name, row in rows.items():
        if name in GPU_ONLY:
            assert row["status"] == SKIPPED and "CUDA" in row["detail"], row
        else:
            assert row["status"] == PASS, row
    assert {name for name, row in rows.items() if row["status"] == SKIPPED} == GPU_ONLY  # what it skipped, named


def test_a_failing_check_fails_the_command(monkeypatch, capsys):
    from trainer.cli import selftest

    failing = [CheckResult("devices", PASS), CheckResult("collectives", FAIL, "", "RuntimeError: no route")]
    monkeypatch.setattr("trainer.selftest.run_selftest", lambda progress, only: failing)
    parser_args = type("Args", (), {"json": None, "only": None})()
    assert selftest._run_selftest(parser_args) == 1
    # A row per check holding its fields, the failure's reason included (the one test of format_table's text).
    out = capsys.readouterr().out.splitlines()
    for check in failing:
        (row,) = [line for line in out if line.split()[:1] == [check.name]]
        assert all(field in row for field in (check.status, check.figure, check.detail)), row


@pytest.mark.gpu
def test_every_check_runs_and_passes_on_a_gpu_node():
    from trainer.selftest import run_selftest

    rows = {row.name: row for row in run_selftest(progress=lambda line: None)}
    assert set(rows) == EVERY_CHECK
    assert all(row.status == PASS for row in rows.values()), [row for row in rows.values() if row.status != PASS]


def test_a_gpu_node_whose_cuda_cannot_start_fails_instead_of_running_the_cpu_subset(monkeypatch):
    from trainer.selftest import local_checks

    monkeypatch.setattr(local_checks, "nvidia_devices_present", lambda: ["nvidia0", "nvidia1"])
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    row = local_checks.devices()
    assert row.status == FAIL and "/dev/nvidia0 is present but CUDA cannot start" in row.detail


def test_nvidia_device_files_are_what_marks_a_gpu_node(tmp_path):
    from trainer.selftest.local_checks import nvidia_devices_present

    for name in ("nvidia0", "nvidia3", "nvidiactl", "nvidia-uvm", "null"):
        (tmp_path / name).touch()
    assert nvidia_devices_present(tmp_path) == ["nvidia0", "nvidia3"]


def test_local_checks_run_on_the_last_visible_gpu_not_device_0(monkeypatch):
    from trainer.selftest.runner import local_device

    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.device_count", lambda: 4)
    assert str(local_device()) == "cuda:3"


def test_a_check_failing_on_one_rank_fails_the_row_naming_that_rank():
    from trainer.selftest.runner import merge_ranks

    ok, bad = CheckResult("collectives", PASS, "1 GB/s", "", 2.0), CheckResult("collectives", FAIL, "", "wrong", 1.0)
    skipped = CheckResult("bf16", SKIPPED, "", "needs a CUDA device")
    rows = merge_ranks({0: [ok, skipped], 1: [bad]}, ["collectives", "bf16"])
    assert rows[0].status == FAIL and rows[0].detail == "rank 1 of 2: wrong"
    assert rows[1].status == FAIL and "not run on ranks [1]" in rows[1].detail
    assert [r.status for r in merge_ranks({0: [ok, skipped], 1: [ok, skipped]}, ["collectives", "bf16"])] == [
        PASS, SKIPPED]


def raises_on_rank_1(dims):
    """Planted: rank 1 raises while rank 0 waits for it in an all-reduce."""
    import torch
    import torch.distributed as dist

    if dims.rank == 1:
        raise RuntimeError("planted failure on rank 1")
    dist.all_reduce(torch.ones(1))
    return CheckResult("raises on rank 1", PASS)


def test_a_rank_raising_while_the_others_wait_in_a_collective_ends_in_a_failure_not_a_hang(monkeypatch):
    from trainer.selftest.distributed_checks import TIMEOUT_ENV, collectives
    from trainer.selftest.runner import run_distributed

    monkeypatch.setenv(TIMEOUT_ENV, "60")  # the bound if a peer's exit went unnoticed
    started = time.monotonic()
    rows = run_distributed(2, (raises_on_rank_1, collectives))
    assert time.monotonic() - started < 60
    assert rows[0].status == FAIL and rows[0].detail.startswith("rank 1 of 2: RuntimeError: planted failure")
    assert rows[1].status == FAIL and "not run" in rows[1].detail


def test_a_pic_store_that_differs_from_the_device_store_fails(monkeypatch):
    import torch

    from trainer.selftest import local_checks

    original = local_checks._pic_steps

    def wrong_host_store(device, row_store, prefetch):
        losses, rows, milliseconds = original(device, row_store, prefetch)
        return losses, rows + (1e-3 if row_store == "host" else 0.0), milliseconds  # finite, but not the rows

    monkeypatch.setattr(local_checks, "_pic_steps", wrong_host_store)
    row = local_checks.pic_host_store(torch.device("cpu"))
    assert row.status == FAIL and "rows diff 1.0e-03" in row.detail


def test_a_host_sync_in_the_smoothing_and_co2_step_fails_the_check(monkeypatch):
    import torch

    from trainer.objectives.instance.objective import InstanceObjective
    from trainer.selftest import local_checks

    original = InstanceObjective.loss

    def syncing_loss(self, step):
        out = original(self, step)
        out.loss.detach().sum().item()  # planted: a host read of the loss every step
        return out

    monkeypatch.setattr(InstanceObjective, "loss", syncing_loss)
    row = local_checks.host_syncs_per_step(torch.device("cpu"))
    assert row.status == FAIL and "test_selftest.py" in row.detail and "_local_scalar_dense" in row.detail
    # The planted sync is the only one found: both objectives' steps, unplanted, have none (the row's pass).
    assert row.figure == "1 syncs (fake CUDA)", row


def test_each_distributed_row_is_named_as_its_check_names_it():
    """A row merged over ranks takes ``check_name``: it must be the name the check reports itself (the
    first GPU run found the GPU step's row renamed after its function whenever it ran)."""
    from trainer.selftest.distributed_checks import DISTRIBUTED_CHECKS, check_name

    assert [check_name(check) for check in DISTRIBUTED_CHECKS] == ["collectives", "sharded classifier",
                                                                     "in1k job step"]
    assert set(map(check_name, DISTRIBUTED_CHECKS)) <= EVERY_CHECK


def shipped_gpu_jobs_deepspeed_files() -> dict[str, str]:
    """Each shipped GPU job (a configs/ file on ``parallel.device: cuda``; the k8s ConfigMaps embed three of
    them) and the DeepSpeed file it names, read from the YAML itself."""
    jobs = {}
    for path in sorted((REPO / "configs").glob("*.yaml")):
        data = yaml.safe_load(path.read_text())
        if data.get("parallel", {}).get("device") == "cuda":
            jobs[path.name] = Path(data["deepspeed_config"]).name
    return jobs


class StoppedAtTheDeepSpeedFile(Exception):
    """Planted: the GPU step stopped where it reads its DeepSpeed file, before any CUDA call."""


def test_the_gpu_step_runs_the_deepspeed_config_the_shipped_gpu_jobs_run(monkeypatch):
    """The step row checks what the cluster runs: a step of a DeepSpeed config no shipped GPU job uses (the
    ZeRO-2 one while they all run ZeRO-0 through autocast) fails here, and so does a shipped job moving to
    a config that no row steps.  On CPU: the check is handed a CUDA device and stopped at its file."""
    import torch

    from trainer.selftest.distributed_checks import shipped_job_step

    shipped = shipped_gpu_jobs_deepspeed_files()
    assert len(shipped) >= 3 and len(set(shipped.values())) == 1, \
        f"the shipped GPU jobs run several DeepSpeed configs ({shipped}): selftest needs a step row for each"
    read = []

    def reading(path, *args, **kwargs):
        read.append(Path(path).name)
        raise StoppedAtTheDeepSpeedFile

    monkeypatch.setattr("trainer.config_deepspeed.load_deepspeed_config", reading)
    with pytest.raises(StoppedAtTheDeepSpeedFile):
        shipped_job_step(SimpleNamespace(device=torch.device("cuda", 0), world_size=1, rank=0))
    assert read == sorted(set(shipped.values()))


def test_a_missing_job_config_names_where_it_looked_and_what_to_do(monkeypatch, tmp_path):
    from trainer.config_building import ConfigError
    from trainer.selftest import shipped_job

    monkeypatch.setattr(shipped_job, "REPO", tmp_path / "site-packages")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        shipped_job.job_config_path()
    message = str(error.value)
    assert str(tmp_path / "site-packages" / "configs" / "in1k_r50_64gpu.yaml") in message
    assert str(tmp_path / "configs" / "in1k_r50_64gpu.yaml") in message and "working directory" in message
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "in1k_r50_64gpu.yaml").write_text("{}")  # the image: configs/ under its WORKDIR
    assert shipped_job.job_config_path() == tmp_path / "configs" / "in1k_r50_64gpu.yaml"

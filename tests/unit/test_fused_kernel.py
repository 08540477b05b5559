"""The fused Triton classifier kernels, run by Triton's interpreter on CPU tensors against the float64
reference (each check in a process of its own: ``tests/helpers/fused_kernel_checks.py`` says why),
and which path runs where."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.helpers.training import REPO
from trainer.classifier.kernel.chunked import KernelSettings

# Not imported from the checks' module: importing it sets TRITON_INTERPRET in this process.
CHECKS = ("every_case_on_one_rank", "padding_and_negative_weights", "in_backward_sgd", "deterministic_repeats",
          "two_gloo_ranks", "ops_trace_under_compile", "positive_logit_and_frozen_rows")
DEFAULT_RUN = {"every_case_on_one_rank", "two_gloo_ranks"}  # each other check runs in `make test-all`
# Two ranks run on CPUs only (gloo's collectives take CPU tensors); tracing the ops needs no GPU.
GPU_SKIPS = {"two_gloo_ranks", "ops_trace_under_compile"}


@pytest.mark.parametrize("check", [check if check in DEFAULT_RUN else pytest.param(check, marks=pytest.mark.slow)
                                   for check in CHECKS])
@pytest.mark.integration
def test_the_fused_kernels_match_the_float64_reference(check):
    result = subprocess.run([sys.executable, "-m", "tests.helpers.fused_kernel_checks", check], cwd=REPO,
                            env={**os.environ, "TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{check}: passed" in result.stdout


@pytest.mark.gpu
@pytest.mark.parametrize("check", [check for check in CHECKS if check not in GPU_SKIPS])
def test_the_compiled_kernels_match_the_float64_reference_on_a_gpu(check):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env |= {"INSTCLS_FUSED_DEVICE": "cuda", "INSTCLS_FUSED_AUTOTUNE": "0"}  # numbers, not speed: one config
    result = subprocess.run([sys.executable, "-m", "tests.helpers.fused_kernel_checks", check], cwd=REPO, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert f"{check}: passed" in result.stdout


def test_cuda_runs_the_fused_path_unless_a_term_rides_along():
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    auto = KernelSettings()
    assert auto.resolved_implementation(cuda, has_term=False) == "fused"
    assert auto.resolved_implementation(cuda, has_term=True) == "chunked"  # CO2 keeps the chunked loop
    assert auto.resolved_implementation(cpu, has_term=False) == "chunked"
    assert KernelSettings(implementation="chunked").resolved_implementation(cuda, has_term=False) == "chunked"
    assert KernelSettings(implementation="fused").resolved_implementation(cpu, has_term=False) == "fused"
    with pytest.raises(ValueError, match="cannot carry a term"):
        KernelSettings(implementation="fused").resolved_implementation(cuda, has_term=True)
    with pytest.raises(ValueError, match="choose one of"):
        KernelSettings(implementation="triton")


def test_the_start_up_line_names_the_path_and_why():
    from data_pipeline.contract import ViewLayout
    from trainer.classifier.classifier_config import ClassifierSettings

    two_views, cuda = ViewLayout.single(), torch.device("cuda", 0)
    assert "fused (Triton" in ClassifierSettings().kernel_choice(two_views, cuda)
    assert "chunked (cpu tensors)" in ClassifierSettings().kernel_choice(two_views, torch.device("cpu"))
    assert "chunked (kernel: chunked)" in ClassifierSettings(kernel="chunked").kernel_choice(two_views, cuda)

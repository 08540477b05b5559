"""The shipped job whose training step ``instcls selftest`` runs on the GPUs: ImageNet-1K on ResNet-50
(``configs/in1k_r50_64gpu.yaml``).  The step takes the DeepSpeed config, the network and the per-GPU batch
from that file, so the row checks what the cluster runs and follows the job config when it changes."""

from __future__ import annotations

from pathlib import Path

from trainer.config_building import ConfigError

JOB_CONFIG = Path("configs") / "in1k_r50_64gpu.yaml"
REPO = Path(__file__).resolve().parents[2]


def job_config_path() -> Path:
    """The job config in the checkout this code runs from, else under the working directory (the image's
    ``/opt/instcls``, whose installed package has no ``configs/``); ``ConfigError`` naming both if neither."""
    candidates = list(dict.fromkeys([REPO / JOB_CONFIG, Path.cwd() / JOB_CONFIG]))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise ConfigError(f"{JOB_CONFIG} not found (looked at {' and '.join(map(str, candidates))}): run instcls "
                      "selftest from the repository's checkout or the image's working directory, which hold configs/")


def load_shipped_job():
    """The job config read as training reads it (its ``deepspeed_config`` resolved to the file)."""
    from trainer.config import load_job_config

    return load_job_config(job_config_path())

"""The fixtures a pod drill mounts in place of the cluster's: the job ConfigMap ``instcls-job``
rendered by ``k8s/render_configmaps.py`` from a CPU config (``configs/demo_cpu.yaml`` by default;
the drills pass their own, ``configs/digits_cpu.yaml`` with their cadence, so that a drill's run
can be compared bit for bit with the uninterrupted run of the same settings), naming the shards
and checkpoints by their mount paths as the shipped ConfigMaps do; and the NCCL ConfigMap as
``k8s/nccl-fabric.yaml`` ships it."""

from __future__ import annotations

import importlib.util

import yaml

from trainer.config_building import apply_overrides
from trainer.drills.jobs import REPO

SHARDS_MOUNT, CHECKPOINTS_MOUNT = "/data/shards", "/checkpoints"
RUN = "drill"  # the job's folder on the checkpoint claim


def _render_configmaps():
    spec = importlib.util.spec_from_file_location("render_configmaps", REPO / "k8s" / "render_configmaps.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def job_config_map(config: str = "configs/demo_cpu.yaml", settings: list[str] = ()) -> dict[str, str]:
    """``instcls-job``'s data: ``config`` with ``settings`` applied, its shards at
    ``/data/shards/{train,val}`` and its checkpoints and logs under ``/checkpoints/drill``."""
    data = yaml.safe_load((REPO / config).read_text())
    apply_overrides(data, [f"data.train_shards={SHARDS_MOUNT}/train", f"data.eval_shards={SHARDS_MOUNT}/val",
                           f"checkpoint.dir={CHECKPOINTS_MOUNT}/{RUN}/checkpoints",
                           f"logging.dir={CHECKPOINTS_MOUNT}/{RUN}/logs", *settings])
    deepspeed = data.pop("deepspeed_config")  # the pod's --set names the mounted copy
    rendered = _render_configmaps().job_configmap(yaml.safe_dump(data, sort_keys=False), (REPO / deepspeed).read_text(),
                                                  config, deepspeed)
    return yaml.safe_load(rendered)["data"]


def nccl_config_map() -> dict[str, str]:
    document = yaml.safe_load((REPO / "k8s" / "nccl-fabric.yaml").read_text())
    return {key: str(value) for key, value in document["data"].items()}

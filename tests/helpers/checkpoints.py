"""Checkpoints written by hand, as the trainer lays them out, for tests of what reads them (export,
``model.init_from``): a job config, a network with non-trivial weights and the files of one checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from data_pipeline.shardset.manifest import ShardManifest
from trainer.checkpoint.checkpoint_files import MODEL_FILE, TRAINER_FILE, checkpoint_name, write_manifest
from trainer.checkpoint.run_fingerprint import FINGERPRINT_KEY, run_fingerprint
from trainer.config import load_job_config
from trainer.models import build_model

SIDE = 32  # the training view size of the jobs written here: data.loader.augment.image_size
HEAD = {"head_hidden_dim": 16, "feature_dim": 8}  # a small projection head


def write_job(folder: Path, model: dict, shards: Path | None = None):
    """A job config of ``model`` whose checkpoints and logs live in ``folder``; returns (path, config)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {"data": {"train_shards": str(shards or folder / "shards"), "loader": {"augment": {"image_size": SIDE}}},
            "model": {**HEAD, **model}, "checkpoint": {"dir": str(folder / "checkpoints")},
            "logging": {"dir": str(folder / "logs")}}
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, load_job_config(path)


def trained_like(config, seed: int = 0):
    """instcls's network with random weights, every norm layer's affine and running statistics off
    their init values (ones, zeros), so that an export that dropped or swapped one would show.  Built
    on the meta device and filled here: timm's own init costs seconds per ViT on a CPU."""
    with torch.device("meta"):
        model = build_model(config.model)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():  # weights at 1/sqrt(fan-in): features neither vanish nor blow up
            scale = parameter[0].numel() ** -0.5 if parameter.dim() > 1 else 0.1
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * scale)
        for module in model.modules():
            if isinstance(module, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm)):
                module.weight.uniform_(0.5, 1.5, generator=generator)
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.running_mean.normal_(0, 0.1, generator=generator)
                module.running_var.uniform_(0.5, 2.0, generator=generator)
                module.num_batches_tracked.fill_(17)
    assert len(dict(model.named_buffers())) == sum(3 for m in model.modules()  # no buffer left unset by to_empty
                                                   if isinstance(m, torch.nn.modules.batchnorm._BatchNorm))
    return model.eval()


def write_checkpoint(config, model, step: int = 12, epoch: int = 3, fingerprint: dict | None = None) -> Path:
    """The files of a checkpoint that an export reads: ``model.pt`` (the consolidated state dict),
    ``trainer.json`` (position, global batch, fingerprint) and ``manifest.json`` (what
    ``--checkpoint auto`` checks)."""
    path = Path(config.checkpoint.dir) / checkpoint_name(step)
    path.mkdir(parents=True)
    torch.save(model.state_dict(), path / MODEL_FILE)
    meta = {"epoch": epoch, "step_in_epoch": 0, "global_step": step, "num_instances": 100, "global_batch": 64,
            "restarts": 0, FINGERPRINT_KEY: fingerprint or run_fingerprint(config, num_instances=100)}
    (path / TRAINER_FILE).write_text(json.dumps(meta))
    write_manifest(path)
    return path


def write_shards_manifest(folder: Path, images: int) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    ShardManifest(num_instances=images, shards=[], source="synthetic", table="samples.bin").save(folder)
    return folder

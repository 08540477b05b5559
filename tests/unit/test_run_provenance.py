"""A run's provenance (run.json): the resolved config reads back as the same job, the code and library
versions and the data's digest are recorded, a checkpoint carries its run's record, and a damaged
record is named."""

import re
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.training import REPO
from trainer.code_identity import git_state
from trainer.config import load_job_config
from trainer.provenance import collect_provenance, describe_provenance, file_sha256, read_provenance
from trainer.provenance.checkpoint_entry import ProvenanceState


def test_the_record_holds_a_config_that_loads_as_the_same_job(digits_shards, tmp_path):
    overrides = [f"data.train_shards={digits_shards}", "optim.epochs=7", "model.arch=resnet34", "seed=5"]
    config = load_job_config(REPO / "configs" / "demo_cpu.yaml", overrides)
    weights = tmp_path / "start.pth"
    torch.save({"w": torch.ones(3)}, weights)
    record = collect_provenance(config, "configs/demo_cpu.yaml", overrides, 2, ["node-a", "node-b"], "abc",
                                init_from={"path": str(weights), "digest": file_sha256(weights)})
    (tmp_path / "resolved.yaml").write_text(record["config"])
    assert load_job_config(tmp_path / "resolved.yaml") == config
    assert record["overrides"] == overrides and record["config_file"] == "configs/demo_cpu.yaml"
    assert (record["world_size"], record["hosts"], record["run"]) == (2, ["node-a", "node-b"], "abc")
    assert record["versions"]["torch"] == torch.__version__.split("+")[0]
    assert record["train_manifest"]["images"] == 1797
    assert record["train_manifest"]["digest"] == file_sha256(digits_shards / "manifest.json")
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", record["init_from"]["digest"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", record["started_at"])
    lines = describe_provenance(record)
    assert record["train_manifest"]["digest"] in lines and "node-a, node-b" in lines and str(weights) in lines


def test_the_code_is_named_by_its_commit_in_a_checkout_and_not_outside_one(tmp_path):
    inside = git_state(REPO)
    assert inside is not None and re.fullmatch(r"[0-9a-f]{40}", inside["commit"]) and isinstance(inside["dirty"], bool)
    assert git_state(tmp_path) is None


def test_a_run_from_the_image_records_the_commit_it_was_built_from_and_the_image(digits_shards, tmp_path,
                                                                                 monkeypatch):
    """No .git (the image), the build's commit and the pod's image in the environment: run.json holds
    both, and the lines `instcls report` and the export's model card show name both."""
    from trainer.export.export_config import InputSpec
    from trainer.export.model_card import model_card

    monkeypatch.setattr("trainer.code_identity._SOURCE", tmp_path)
    monkeypatch.setenv("INSTCLS_GIT_COMMIT", "c0ffee" * 6 + "beef")
    monkeypatch.setenv("INSTCLS_GIT_DIRTY", "true")
    monkeypatch.setenv("INSTCLS_IMAGE", "registry.example.com/instcls@sha256:" + "0" * 64)
    config = load_job_config(REPO / "configs" / "demo_cpu.yaml", [f"data.train_shards={digits_shards}"])
    record = collect_provenance(config, None, [], 1, ["pod-0"], "run")
    assert record["git"] == {"commit": "c0ffee" * 6 + "beef", "dirty": True}
    assert record["image"] == "registry.example.com/instcls@sha256:" + "0" * 64
    expected = ["git " + "c0ffee" * 6 + "beef (dirty: uncommitted changes)",
                "image registry.example.com/instcls@sha256:" + "0" * 64]
    assert describe_provenance(record).splitlines()[1:3] == expected
    exported = {"instcls": {"arch": "resnet18", "library": "torchvision", "architecture": "resnet18", "width": 512,
                            "input_norm": "none", "checkpoint": {"path": "ckpt"}}}
    card = model_card(config, exported, "network = ...\n", {"global_step": 1, "epoch": 1}, None, record,
                      record["train_manifest"], InputSpec(32, 37, (0.5,) * 3, (0.25,) * 3), tmp_path)
    provenance = card.split("## Provenance", 1)[1]
    assert all(line in provenance.splitlines() for line in expected)
    assert "image not recorded (a run.json written before" in describe_provenance({
        key: value for key, value in record.items() if key != "image"})


def test_a_checkpoint_carries_the_record_of_the_run_that_wrote_it(tmp_path):
    record = {"format": 1, "run": "abc", "config": "seed: 0\n"}
    dims = SimpleNamespace(rank=0)
    (write,) = ProvenanceState(record).snapshot(tmp_path, dims, 4)
    write.save(write.payload, tmp_path / write.path)
    assert read_provenance(tmp_path) == record
    assert ProvenanceState(None).snapshot(tmp_path, SimpleNamespace(rank=1), 4) == []  # rank 0 writes it alone
    assert read_provenance(tmp_path / "elsewhere") is None  # written before provenance was recorded
    (tmp_path / "run.json").write_text('{"format": 1, "cut off')
    with pytest.raises(ValueError, match=r"run\.json is unreadable"):
        read_provenance(tmp_path)


def test_a_missing_start_file_is_recorded_and_left_to_the_load_to_refuse(digits_shards, tmp_path):
    """Rank 0 records the run before the network is built: a missing ``init_from`` is noted, not
    raised there alone (every rank then refuses it as it loads it, naming the fix)."""
    from trainer.provenance.run_start import record_run_start

    config = load_job_config(REPO / "configs" / "demo_cpu.yaml", [
        f"data.train_shards={digits_shards}", f"model.init_from={tmp_path / 'gone.pth'}",
        f"logging.dir={tmp_path / 'logs'}"])
    state = record_run_start(config, SimpleNamespace(rank=0, world_size=1, is_distributed=False), "run", None, None)
    assert state.provenance["init_from"]["digest"] is None and "gone.pth" in state.provenance["init_from"]["error"]
    assert read_provenance(tmp_path / "logs") == state.provenance

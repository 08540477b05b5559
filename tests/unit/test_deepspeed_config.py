"""DeepSpeed configs the trainer refuses, with errors naming the file, the field and the fix."""

import json

import pytest

from trainer.config import ConfigError
from trainer.engine.deepspeed_setup import load_deepspeed_config


@pytest.mark.parametrize("section", ["fp16", "amp"])
def test_fp16_config_is_refused_naming_file_field_and_fix(tmp_path, section):
    path = tmp_path / "zero2_fp16.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, section: {"enabled": True}}))
    with pytest.raises(ConfigError) as error:
        load_deepspeed_config(path, micro_batch=4)
    message = str(error.value)
    assert str(path) in message and f"{section}.enabled" in message
    assert '"bf16": {"enabled": true}' in message and "ds_configs/zero2_bf16.json" in message


def test_bf16_and_disabled_fp16_configs_load(tmp_path):
    path = tmp_path / "zero2.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "fp16": {"enabled": False},
                                "bf16": {"enabled": True}}))
    assert load_deepspeed_config(path, micro_batch=4)["train_micro_batch_size_per_gpu"] == 4

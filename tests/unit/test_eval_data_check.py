"""What a run checks of its evaluation data before step 1 (labels, at least knn_k bank samples, at
least 2 classes), and the one line it says when evaluation is off."""

import pytest

from data_pipeline.contract import sample_table
from data_pipeline.ingest.make_shards import ShardSettings, write_shards
from data_pipeline.ingest.sources.generated import Source, SourceImage
from tests.helpers.training import REPO
from trainer.config import load_job_config
from trainer.evaluation.eval_data_check import check_evaluation_data, evaluation_off_line

DEMO = REPO / "configs" / "demo_cpu.yaml"


def _copy(shards, out, count, label):
    """The first ``count`` images of ``shards`` with one label for all (-1: none)."""
    table = sample_table(shards)
    images = [SourceImage(f"{i}", label, lambda i=i: table.read_jpeg(i)) for i in range(count)]
    write_shards(Source("copy", images, None if label < 0 else ["only"]), out,
                 ShardSettings(prefix="copy", samples_per_shard=64), progress=False)
    return out


def _config(train, val, *extra):
    return load_job_config(DEMO, [f"data.train_shards={train}", f"data.eval_shards={val}", *extra])


def test_labelled_sets_pass_and_each_defect_is_named_with_its_field(digits_shards, tmp_path):
    check_evaluation_data(_config(digits_shards, digits_shards))
    unlabelled = _copy(digits_shards, tmp_path / "unlabelled", 30, -1)
    one_class = _copy(digits_shards, tmp_path / "one-class", 30, 0)
    cases = [
        (_config(digits_shards, unlabelled), r"data\.eval_shards=.*unlabelled: 30 of its 30 samples have no label"),
        (_config(unlabelled, digits_shards), r"data\.train_shards \(the kNN bank\)=.*: 30 of its 30 .* set "
                                             r"data\.knn_bank_shards"),
        (_config(unlabelled, digits_shards, f"data.knn_bank_shards={one_class}"),
         r"data\.knn_bank_shards=.*one-class has a single class"),
        (_config(one_class, digits_shards, "eval.knn_k=31"), r"holds 30 samples, fewer than eval\.knn_k=31"),
        (_config(digits_shards, tmp_path / "nowhere"), r"data\.eval_shards=.*nowhere.*manifest\.json not found"),
    ]
    for config, message in cases:
        with pytest.raises(ValueError, match=message):
            check_evaluation_data(config)
    # a bank subset is checked as the subset it is
    check_evaluation_data(_config(digits_shards, digits_shards, "eval.bank_samples=25"))


def test_without_eval_shards_one_line_names_the_settings_that_do_nothing(digits_shards):
    config = load_job_config(DEMO, [f"data.train_shards={digits_shards}", "data.eval_shards=null"])
    line = evaluation_off_line(config)
    assert line.startswith("evaluation is off (data.eval_shards is unset): eval.knn_at_end, eval.every_epochs=4, "
                           "eval.linear_at_end therefore do nothing"), line
    check_evaluation_data(config)  # nothing to check: evaluation is off
    assert evaluation_off_line(_config(digits_shards, digits_shards)) is None

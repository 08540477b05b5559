"""`make demo` shows learning: on its digit scenes a random network scores at most 50% kNN and the
trained one at least 20 points more (the floor the demo is held to).  Measured: +29.5 (seed 0, on the machine of
the README's table), +30.6 and +39.8 points (seeds 1 and 2, on a machine with another processor):
the floor is 9.5 points below the lowest seed, so another processor's trajectory, which differs
as another seed's does, clears it.  Slow: it is the whole demo, ~5 minutes."""

import json

import pytest

from tests.helpers.training import run_train

pytestmark = pytest.mark.integration


@pytest.mark.slow
def test_the_demo_beats_its_random_init_by_twenty_points_on_digit_scenes(scene_shards, tmp_path):
    run_train(tmp_path / "run", scene_shards, 2, ["eval.knn_at_end=true"], config="demo_cpu.yaml", timeout=900)
    records = [json.loads(line) for line in (tmp_path / "run" / "logs" / "rank-00000.jsonl").read_text().splitlines()]
    final = [r for r in records if r["event"] == "eval"][-1]
    assert final["final"] and final["knn_random_init"] <= 0.5, final
    assert final["knn_trained"] >= final["knn_random_init"] + 0.2, final

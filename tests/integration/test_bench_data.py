"""`instcls bench data` measures both loaders on the same shards, with and without multi-crop, and
reports their ratios."""

from trainer.cli import main


def test_bench_data_reports_both_loaders_with_and_without_multicrop(digits_shards, capsys):
    args = f"bench data --shards {digits_shards} --crop-size 32 --batch 32 --batches 3 --warmup 1"
    assert main(args.split()) == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        if line.startswith("2 x 32px"):
            views, numbers = line[:28].strip(), line[28:].split()
            rows[views] = [float(numbers[0]), float(numbers[1]), float(numbers[2].rstrip("x"))]
    assert set(rows) == {"2 x 32px", "2 x 32px + 6 x 13px"}, out
    for dali, fallback, ratio in rows.values():
        assert dali > 0 and fallback > 0
        assert abs(ratio - dali / fallback) < 0.01 * ratio + 0.01
    plain, multicrop = rows["2 x 32px"], rows["2 x 32px + 6 x 13px"]
    reported = out.split("multi-crop images/s vs 2 x 32px: DALI ")[1]
    assert abs(float(reported.split("x")[0]) - multicrop[0] / plain[0]) < 0.01

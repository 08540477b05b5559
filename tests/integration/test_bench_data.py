"""`instcls bench data` measures both loaders on the same shards and reports their ratio."""

from trainer.cli import main


def test_bench_data_reports_both_loaders(digits_shards, capsys):
    args = f"bench data --shards {digits_shards} --crop-size 32 --batch 32 --batches 3 --warmup 1"
    assert main(args.split()) == 0
    out = capsys.readouterr().out
    rates = {}
    for line in out.splitlines():
        if line.startswith(("DALI ", "PIL + torchvision")) and "/" not in line:
            name, value = line.rsplit(maxsplit=1)
            rates[name.strip()] = float(value)
    assert rates["DALI"] > 0 and rates["PIL + torchvision"] > 0
    ratio = float(out.split("DALI / fallback: ")[1].split("x")[0])
    assert abs(ratio - rates["DALI"] / rates["PIL + torchvision"]) < 0.01 * ratio + 0.01

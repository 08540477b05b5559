"""`instcls eval` (a checkpoint's frozen-feature accuracy) and `instcls report` (a finished run's
summary and curves, from its logs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer.cli.training import add_config_options

CONFIG_HELP = ("job config YAML; optional with --checkpoint DIR, whose run.json holds the run's resolved config "
               "(used when --config is not given; --set then changes it, e.g. --set data.eval_shards=PATH). Given, "
               "it must build the checkpoint's network (a differing model.* architecture field is refused, naming "
               "it); its other values (paths, eval.*, logging) win. Data are compared by manifest digest, not path: "
               "with data.knn_bank_shards unset the bank is data.train_shards, which must hold the shards the run "
               "trained on (refused otherwise); data.eval_shards and data.knn_bank_shards may be any labelled sets")


def register(commands) -> None:
    parser = commands.add_parser("eval", help="kNN or linear-probe accuracy of a checkpoint's frozen backbone")
    parser.add_argument("protocol", choices=["knn", "linear"])
    add_config_options(parser, config_help=CONFIG_HELP)
    parser.add_argument("--checkpoint", required=True,
                        help="checkpoint directory, 'auto' for the newest in the --config's checkpoint.dir, or "
                        "'random-init' for the untrained network of the --config's seed (the baseline a trained "
                        "one must beat)")
    parser.add_argument("--features-out", type=Path,
                        help="also write the bank's and the held-out set's backbone features, labels and ids here "
                        "(torch.save, sorted by id; gathered in memory: for held-out sets and eval.bank_samples "
                        "subsets)")
    parser.set_defaults(handler=_run_eval)

    parser = commands.add_parser("report", help="a finished run's summary table, its provenance (run.json) and a "
                                 "PNG of its curves, from its logs")
    parser.add_argument("--logs", type=Path, required=True, help="the run's logging.dir (rank-*.jsonl)")
    parser.add_argument("--png", type=Path, help="also write loss, kNN per epoch, throughput and memory here")
    parser.set_defaults(handler=_run_report)


def _run_eval(args: argparse.Namespace) -> int:
    from data_pipeline.contract import use_storage_settings
    from trainer.checkpoint.checkpoint_files import load_model_weights
    from trainer.checkpoint.run_fingerprint import refuse_another_jobs_checkpoint, run_fingerprint
    from trainer.config import load_job_config
    from trainer.evaluation.checkpoint_eval import frozen_accuracy, random_init_model, require_eval_shards
    from trainer.evaluation.training_data_check import check_bank_is_training_data
    from trainer.models import build_model
    from trainer.provenance.checkpoint_config import checkpoint_and_config

    if args.checkpoint == "random-init":
        if args.config is None:
            raise ValueError("--checkpoint random-init builds the untrained network from the config's seed: pass "
                             "--config FILE")
        config = load_job_config(args.config, args.overrides)
        use_storage_settings(config.data.storage)
        require_eval_shards(config, args.config)
        checkpoint, model = "random-init", random_init_model(config)
    else:
        checkpoint, config = checkpoint_and_config(args.checkpoint, args.config, args.overrides)
        use_storage_settings(config.data.storage)
        require_eval_shards(config, args.config or checkpoint / "run.json")
        check_bank_is_training_data(config, checkpoint)
        refuse_another_jobs_checkpoint(checkpoint, run_fingerprint(config, num_instances=0), model_only=True)
        model = build_model(config.model)
        model.load_state_dict(load_model_weights(checkpoint))
    result = frozen_accuracy(model, config, args.protocol, args.features_out)
    if result.rank == 0:
        # The digest is the one the trainer logs with each evaluation (``query_features_digest``):
        # equal digests mean the held-out features are bit-identical to the ones it scored.
        print(f"{result.label} accuracy of {checkpoint}: {100 * result.accuracy:.2f}% "
              f"({result.accuracy!r}; held-out features digest {result.query_features_digest})")
        details = result.details or {}
        if details.get("top5") is not None:
            print(f"top-5: {100 * details['top5']:.2f}%")
        if "choice" in details:  # the sweep's pick, scored on the held-out part of the bank
            choice = details["choice"]
            print(f"chosen head: lr {choice['learning_rate']:g}, weight decay {choice['weight_decay']:g} "
                  f"({100 * choice['held_out_top1']:.2f}% on the held-out part of the bank, of "
                  f"{len(choice['grid'])} heads)")
    return 0


def _run_report(args: argparse.Namespace) -> int:
    from trainer.observability.report import RunLogs, plot_run, summary_table
    from trainer.provenance import describe_provenance, read_provenance

    logs = RunLogs.read(args.logs)
    print(summary_table(logs))
    provenance = read_provenance(args.logs)  # logging.dir/run.json, the last start's
    if provenance is not None:
        print(f"\nprovenance ({args.logs / 'run.json'}):\n{describe_provenance(provenance)}")
        print(f"resolved config:\n{provenance['config']}")
    if args.png:
        print(f"curves: {plot_run(logs, args.png)}")
    return 0

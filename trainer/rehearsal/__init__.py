"""`make rehearsal`: the ImageNet-1K job's whole path at its N, with real files, on one CPU machine.

    python -m trainer.rehearsal --work-dir out/rehearsal                 # N = 1,281,167 (35-45 minutes here)
    python -m trainer.rehearsal --work-dir out/rehearsal-smoke --images 20000   # the same path in minutes

Stages (``trainer.rehearsal.stages``): N synthetic images written by parallel `make-shards` parts and
merged; the sample table's open time; a labelled kNN slice; `instcls plan`'s prediction; `instance`
with the full N-way classifier on 2 nodes x 1 rank (an asynchronous checkpoint, a blocking one at
the end); a resume of that checkpoint onto 3 ranks; sharded kNN on 3 ranks.  Every stage runs the
project's own commands as a user or a cluster would, and the figures are read from their outputs
and JSON logs (``trainer.rehearsal.report``).  Not in CI: docs/benchmarks.md holds the figures.
"""

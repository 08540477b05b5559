"""What `instcls plan --config ... --cpu` predicts per rank for the rehearsal's two jobs, to set
next to the peak RSS measured.  The prediction counts tensors (W, its gradient and momentum, the
chunk workspace, the backbone and its activations) and the host copies the background saves keep;
a CPU process also holds the Python and torch runtime, DALI and the loader's buffers, which
`instcls plan --cpu` measures as a line of its own and ``predicted_bytes`` leaves out, so measured
RSS sits above it by a roughly constant amount."""

from __future__ import annotations

from trainer.rehearsal import processes
from trainer.rehearsal.processes import INSTCLS
from trainer.rehearsal.settings import RehearsalSettings


def predicted_bytes(settings: RehearsalSettings, ranks: int, batch_per_rank: int) -> dict:
    """The DHP total and its breakdown per rank, through the code behind `instcls plan --config`."""
    from dataclasses import replace

    from trainer.config import load_job_config
    from trainer.planning import predict
    from trainer.planning.plan_from_config import plan_input_from_config

    config = load_job_config(settings.config, [*settings.job_overrides(), f"data.loader.batch_size={batch_per_rank}"])
    plan = replace(plan_input_from_config(config, ranks, settings.images), device="cpu")
    breakdown = predict(plan)
    return {"ranks": ranks, "dim": plan.dim, "total": sum(breakdown.values()), "breakdown": breakdown}


def plan(settings: RehearsalSettings) -> dict:
    """Both jobs' predictions, and `instcls plan`'s own text for the 2-rank job (kept in the work dir)."""
    processes.run([*INSTCLS, "plan", "--config", str(settings.config), "--ranks", "2", "--cpu",
                   "--num-classes", str(settings.images), "--gpu-memory-gib", "11"],
                  settings.command_output / "plan-2-ranks.txt", "instcls plan")
    return {"two_nodes": predicted_bytes(settings, 2, settings.batch_per_rank),
            "resumed": predicted_bytes(settings, settings.resume_ranks,
                                       settings.global_batch // settings.resume_ranks)}

"""``instcls dry-run``: a job's step on fake CUDA devices, as a few of its ranks, and what it found.

Each simulated rank runs in turn in this process (``rank_step.run_rank``).  The result holds every
rank's report, the first place where their collectives disagree, and the planner's prediction for
the same job, so the measured memory is printed next to ``instcls plan``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config import JobConfig
from trainer.dry_run.collectives import Disagreement, first_disagreement
from trainer.dry_run.rank_step import GPUS_PER_NODE, RankReport, engine_dtype_of, run_rank

GIB = 1 << 30


@dataclass
class DryRunResult:
    world_size: int
    num_instances: int
    rank: int  # the rank whose memory and syncs are reported
    reports: dict[int, RankReport]
    disagreement: Disagreement | None
    planned: dict[str, int] = field(default_factory=dict)  # the planner's breakdown, {} without a model
    planned_objective: int | None = None  # the part of it the step executes (the objective's memory plan)

    @property
    def report(self) -> RankReport:
        return self.reports[self.rank]

    @property
    def stopped(self) -> dict[int, str]:
        return {rank: r.stopped for rank, r in self.reports.items() if r.stopped}

    def step_syncs(self) -> dict:
        """Syncs of the training thread during the steps, on any simulated rank."""
        found: dict = {}
        for report in self.reports.values():
            for sync, steps in report.step_syncs.items():
                if not sync.background:
                    found[sync] = max(found.get(sync, 0), steps)
        return found

    def recompilations(self) -> dict[int, list]:
        """Inductor compilations asked for after the first step, by rank: each one a stall of seconds that
        the real job pays in every step whose shapes are new."""
        return {rank: [c for step in r.compilations[1:] for c in step] for rank, r in self.reports.items()
                if any(r.compilations[1:])}

    def recompiles_per_step(self) -> bool:
        """Some rank compiled in more than half of the steps after the first: a compile per step.
        (Shapes bucketed to powers of two compile a few times while they grow, then never.)"""
        return any(sum(1 for step in r.compilations[1:] if step) * 2 > len(r.compilations) - 1
                   for r in self.reports.values() if len(r.compilations) > 1)

    @property
    def clean(self) -> bool:
        """No stop (device mismatch, error), no disagreement, no host sync on the training thread per
        step, no compile in most steps."""
        return (not self.stopped and self.disagreement is None and not self.step_syncs()
                and not self.recompiles_per_step())


def default_compared_ranks(world_size: int, rank: int) -> list[int]:
    """The reported rank, the first and last, and the first rank of another node."""
    return sorted({rank, 0, world_size - 1, min(GPUS_PER_NODE, world_size - 1)})


def _planned(config: JobConfig, world_size: int, num_instances: int) -> tuple[dict[str, int], int | None]:
    """The planner's breakdown of the job and its objective's part, from the objective's own memory
    plan; ``({}, None)`` for an objective without one (the executed step is shown alone)."""
    from trainer.objectives import NoMemoryPlan
    from trainer.planning import backbone_breakdown, objective_breakdown, runtime_breakdown
    from trainer.planning.plan_from_config import plan_input_from_config

    try:
        plan = plan_input_from_config(config, world_size, num_instances)
    except NoMemoryPlan:
        return {}, None
    objective = objective_breakdown(plan)
    return objective | backbone_breakdown(plan) | runtime_breakdown(plan), sum(objective.values())


def dry_run_job(config: JobConfig, num_instances: int, world_size: int, rank: int = 0,
                compare: list[int] | None = None, steps: int = 3, epoch: int = 0, progress=None) -> DryRunResult:
    if not 0 <= rank < world_size:
        raise ValueError(f"--rank {rank} is invalid: use a rank in [0, {world_size})")
    ranks = sorted(set(compare if compare is not None else default_compared_ranks(world_size, rank)) | {rank})
    if bad := [r for r in ranks if not 0 <= r < world_size]:
        raise ValueError(f"--compare {bad} is invalid: use ranks in [0, {world_size})")
    reports = {}
    for simulated in ranks:
        reports[simulated] = run_rank(config, num_instances, world_size, simulated, steps, epoch)
        if progress is not None:
            progress(f"rank {simulated}: {reports[simulated].seconds:.1f} s")
    planned, planned_objective = _planned(config, world_size, num_instances)
    disagreement = first_disagreement({r: report.collectives for r, report in reports.items()})
    return DryRunResult(world_size, num_instances, rank, reports, disagreement, planned, planned_objective)


def _gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GIB:.2f}"


def format_result(result: DryRunResult, config: JobConfig, source: str) -> str:
    report = result.report
    lines = [
        f"dry run of {source}: N={result.num_instances:,} as rank {result.rank} of {result.world_size} on fake "
        f"cuda:{result.rank % GPUS_PER_NODE} ({str(engine_dtype_of(config)).removeprefix('torch.')} head features), "
        f"{report.steps} steps; ranks simulated: {', '.join(map(str, sorted(result.reports)))}",
        "",
        f"{'memory per rank (GiB)':<40}{'executed':>10}{'planned':>10}",
        f"{'  objective step (peak)':<40}{_gib(report.peak_bytes):>10}{_gib(result.planned_objective):>10}",
        f"{'  building it, starting the epoch (peak)':<40}{_gib(report.setup_peak_bytes):>10}{'-':>10}   (not "
        "planned: once per run or epoch)",
    ]
    if result.planned:
        rest = sum(result.planned.values()) - result.planned_objective
        lines += [f"{'  backbone, ZeRO, DALI, runtime':<40}{'-':>10}{_gib(rest):>10}   (the planner's formula: "
                  "DeepSpeed's engine needs a real device)",
                  f"{'  total':<40}{_gib(report.peak_bytes + rest):>10}{_gib(sum(result.planned.values())):>10}"]
    else:
        lines.append("  (the objective has no memory plan (ObjectiveConfig.memory_plan): only the executed step is "
                     "shown)")
    lines.append("")
    stopped = result.stopped
    lines.append("device mismatches and errors: " + ("none" if not stopped else ""))
    lines += [f"  rank {rank}: {text}" for rank, text in stopped.items()]
    syncs = result.step_syncs()
    lines.append(f"host syncs per step on the training thread: {'none' if not syncs else len(syncs)}")
    lines += [f"  {steps}/{report.steps} steps  {sync}" for sync, steps in syncs.items()]
    background = {s: n for r in result.reports.values() for s, n in r.step_syncs.items() if s.background}
    if background:
        lines.append(f"host waits in worker threads (they do not stall the training thread): {len(background)}")
        lines += [f"  {steps}/{report.steps} steps  {sync}" for sync, steps in background.items()]
    lines.append(f"host syncs once per run or epoch (building the objective, starting the epoch): "
                 f"{len(report.setup_syncs) or 'none'}")
    lines += [f"  {sync}" for sync in report.setup_syncs]
    first = report.compilations[0] if report.compilations else []
    lines.append(f"inductor compilations in the first step: {len(first) or 'none'}")
    lines += [f"  {compilation}" for compilation in first]
    recompiled = result.recompilations()
    verdict = " (in most steps: a compile per step)" if result.recompiles_per_step() else ""
    lines.append(f"recompilations after the first step: {'none' if not recompiled else verdict}")
    for rank, compilations in recompiled.items():
        steps = sum(1 for step in result.reports[rank].compilations[1:] if step)
        lines.append(f"  rank {rank}: {len(compilations)} in {steps} of {report.steps - 1} steps, e.g. "
                     f"{compilations[-1]}")
    counts: dict[str, int] = {}
    for collective in report.collectives:
        counts[collective.op] = counts.get(collective.op, 0) + 1
    lines.append(f"collectives of rank {result.rank}: {len(report.collectives)} "
                 f"({', '.join(f'{n} {op}' for op, n in counts.items()) or 'none'})")
    lines.append("collectives agree across the simulated ranks" if result.disagreement is None
                 else f"collectives DISAGREE (the job would hang): {result.disagreement}")
    lines.append("")
    lines.append("clean: nothing found" if result.clean else "NOT clean: see above")
    return "\n".join(lines)

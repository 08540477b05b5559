"""Import directions, held by a test: every package has a layer, a module imports only from its own
layer or below, nothing forms an import cycle (lazy imports inside functions count: they hide a
cycle, they do not remove it), and the library layers of the trainer reach the data pipeline only
through its contract module.  A failure names the offending import.

    foundation < parallel < optim < data < observability < models < classifier < objectives < config
               < checkpoint < provenance < evaluation < planning < elastic < engine < export < tools < cli < api

The package ``trainer`` itself (its ``__init__``: ``trainer.train``, ``Trainer``, ``load_job_config``,
imported on first use) is the API layer on top; a module of the package that no layer lists is an
error, not a module of that layer.

Inside the data pipeline: shardset (the on-disk format) < ingest, and shardset < loading; ingest
and loading never import each other.  docs/architecture.md explains each layer and where a new
piece goes.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("trainer", "data_pipeline", "ds_configs")

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("foundation", ("trainer.exit_codes", "trainer.checks", "trainer.failpoints", "trainer.version",
                    "trainer.code_identity", "trainer.temp_files", "ds_configs")),
    ("parallel", ("trainer.parallel",)),
    ("optim", ("trainer.optim",)),  # the backbone's optimizers: the config validates names, the engine builds
    ("data", ("data_pipeline",)),
    ("observability", ("trainer.observability",)),
    ("models", ("trainer.models",)),
    ("classifier", ("trainer.classifier",)),  # a second kernel backend goes in trainer/classifier/kernel/
    ("objectives", ("trainer.objectives",)),
    # the job config, with what it reads of DeepSpeed's file (config_deepspeed) and its sections' settings
    ("config", ("trainer.config_building", "trainer.eval_config", "trainer.config", "trainer.config_elastic",
                "trainer.config_deepspeed", "trainer.config_tracking")),
    ("checkpoint", ("trainer.checkpoint",)),
    ("provenance", ("trainer.provenance",)),  # run.json: what made a run, written by the engine, read by export
    ("evaluation", ("trainer.evaluation",)),
    # the memory planner: objectives describe their state, it reads configs and DeepSpeed's settings; the
    # elastic check at the smallest size asks it
    ("planning", ("trainer.planning",)),
    ("elastic", ("trainer.elastic",)),  # the global batch across world sizes, what a restart cost
    ("engine", ("trainer.engine",)),
    ("export", ("trainer.export",)),  # a checkpoint's backbone out to timm / torchvision, with its model card
    ("tools", ("trainer.bench", "trainer.drills", "trainer.selftest", "trainer.ablations", "trainer.dry_run",
               "trainer.rehearsal")),
    ("cli", ("trainer.cli",)),
    ("api", ("trainer",)),
]
# Layers named by a whole module, not a prefix: the package's __init__ only.
EXACT = {"trainer"}
DATA_LAYERS = {"data_pipeline.shardset": 0, "data_pipeline.ingest": 1, "data_pipeline.loading": 1,
               "data_pipeline.contract": 2, "data_pipeline": 0}
# The trainer's library layers see the data pipeline through this module only (the tools and the
# CLI make shards, bench loaders and may import any of it).
DATA_CONTRACT = "data_pipeline.contract"
LIBRARY_LAYERS = ("models", "classifier", "objectives", "config", "checkpoint", "provenance", "evaluation", "elastic",
                  "engine", "export")


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")


def import_graph(root: Path = ROOT) -> dict[str, dict[str, int]]:
    """``{module: {imported project module: line}}``, lazy imports included."""
    modules = {module_name(p): p for package in PACKAGES for p in (root / package).rglob("*.py")}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges: dict[str, int] = {}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                           for alias in node.names]
            for target in targets:
                while target and target not in modules:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    edges.setdefault(target, node.lineno)
        graph[name] = edges
    return graph


def layer_of(module: str) -> int:
    best, found = -1, None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or (module.startswith(prefix + ".") and prefix not in EXACT)) and len(prefix) > best:
                best, found = len(prefix), index
    if found is None:
        raise AssertionError(f"{module} has no layer: add its package to LAYERS in tests/unit/test_layers.py")
    return found


def _data_layer(module: str) -> int:
    return max((rank, len(prefix)) for prefix, rank in DATA_LAYERS.items()
               if module == prefix or module.startswith(prefix + "."))[0]


def _data_area(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def wrong_imports(graph: dict[str, dict[str, int]]) -> list[str]:
    problems = []
    for module, edges in sorted(graph.items()):
        mine = layer_of(module)
        for target, line in sorted(edges.items()):
            theirs = layer_of(target)
            where = f"{module} (line {line}) imports {target}"
            if theirs > mine:
                problems.append(f"{where}: layer {LAYERS[theirs][0]} is above {LAYERS[mine][0]}")
            elif LAYERS[mine][0] in LIBRARY_LAYERS and LAYERS[theirs][0] == "data" and target != DATA_CONTRACT:
                problems.append(f"{where}: the trainer's library layers import the data pipeline through "
                                f"{DATA_CONTRACT} only")
            elif LAYERS[mine][0] == LAYERS[theirs][0] == "data" and (
                    _data_layer(target) > _data_layer(module)
                    or _data_layer(target) == _data_layer(module) == 1 and _data_area(target) != _data_area(module)):
                problems.append(f"{where}: {_data_area(module)} may not import {_data_area(target)}")
    return problems


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Every import cycle (one per strongly connected component of more than one module)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]

    def visit(node: str) -> None:  # Tarjan's algorithm
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_import_points_down_or_sideways_and_the_data_pipeline_is_reached_through_its_contract():
    assert wrong_imports(import_graph()) == []


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_a_planted_upward_import_a_contract_bypass_and_a_cycle_are_named():
    graph = import_graph()
    graph["trainer.parallel.dims"] = dict(graph["trainer.parallel.dims"], **{"trainer.engine.trainer": 7})
    graph["trainer.classifier.head"] = dict(graph["trainer.classifier.head"],
                                            **{"data_pipeline.loading.batch": 9})
    graph["data_pipeline.ingest.validate"] = dict(graph["data_pipeline.ingest.validate"],
                                                  **{"data_pipeline.loading.loader": 3})
    problems = wrong_imports(graph)
    assert problems == [
        "data_pipeline.ingest.validate (line 3) imports data_pipeline.loading.loader: data_pipeline.ingest may not "
        "import data_pipeline.loading",
        "trainer.classifier.head (line 9) imports data_pipeline.loading.batch: the trainer's library layers import "
        "the data pipeline through data_pipeline.contract only",
        "trainer.parallel.dims (line 7) imports trainer.engine.trainer: layer engine is above parallel",
    ]
    graph = import_graph()
    graph["trainer.engine.schedule"] = {"trainer.engine.trainer": 1}  # the trainer imports the schedule
    assert cycles(graph) == [["trainer.engine.schedule", "trainer.engine.trainer"]]

"""The layering of ``pipeline/``, read from the source with ``ast`` (every import, at module level or inside a
function): no import circle among the pipeline's modules, no module importing a stage entry point
(``python -m pipeline.<stage>``), and the cost model at the bottom layer (``pipeline.costs`` reaches only
``pipeline.models`` and ``pipeline.decoding``, and importing it loads no other pipeline module)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from pipeline import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "pipeline"
STAGES = {"pipeline.label", "pipeline.dataset", "pipeline.train", "pipeline.evaluate", "pipeline.serve", "pipeline.draft"}

# Known edges owned by other work in progress (issue 23), allowed here so that this test guards everything else.
# TODO(integrator): drop each entry once the branch that removes the edge is merged; the test then guards it too.
KNOWN_EDGES = {
    # TODO: policy/retest.py builds datasets and trains through the dataset and train stages (issue 23 item 1/4).
    ("pipeline.policy.retest", "pipeline.dataset"),
    ("pipeline.policy.retest", "pipeline.train"),
    # TODO: models/loading.py builds the decoder, an upward import models -> decoding (closes models <-> decoding).
    ("pipeline.models.loading", "pipeline.decoding.speculative"),
    # TODO: the benchmarks write their JSON with the eval stage's write_json (the evaluate split moves it, issue 23 item 4).
    ("pipeline.bench_label", "pipeline.evaluate"),
    ("pipeline.bench_serve", "pipeline.evaluate"),
    ("pipeline.bench_step", "pipeline.evaluate"),
    # TODO: read the labels and feature splits from their homes, pipeline.labeling.store.read_label_table,
    # pipeline.policy.features.load_feature_dataset / split_prompt_ids (the dataset stage only re-imports them).
    ("pipeline.evaluate", "pipeline.dataset"),
    ("pipeline.train", "pipeline.dataset"),
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PROJECT_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def is_stage(name: str) -> bool:
    return name in STAGES or name.startswith("pipeline.bench_")


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The pipeline modules ``name`` imports (``from a import b`` names module ``a.b`` when it is one)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    out = set()
    for target in found:
        while target and target not in known:  # `import pipeline.a.b.c` where c is an attribute, not a module
            target = target.rpartition(".")[0]
        if target and target.startswith("pipeline") and target != name:
            out.add(target)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def without_known(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    return {a: {b for b in targets if (a, b) not in KNOWN_EDGES} for a, targets in graph.items()}


def test_the_walk_reads_imports_and_finds_a_planted_cycle():
    graph = import_graph()
    assert "pipeline.costs" in graph["pipeline.labeling.oracle"]  # a module-level import
    assert "pipeline.costs" in graph["pipeline.serve"]  # `from pipeline import costs` inside a function
    assert "pipeline.policy.retest" in graph and "pipeline.train" in graph["pipeline.policy.retest"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_among_pipeline_modules():
    found = cycles(without_known(import_graph()))
    assert found == [], f"import circles (break each by moving the shared code down a layer): {found}"


def test_no_module_imports_a_stage_entry_point():
    graph = without_known(import_graph())
    bad = sorted((a, b) for a, targets in graph.items() for b in targets if is_stage(b))
    assert bad == [], f"modules importing a stage entry point (move what they need into its package): {bad}"


def test_known_edges_still_exist():
    """An allowlisted edge that is gone should leave the allowlist (so it cannot come back unnoticed)."""
    graph = import_graph()
    gone = sorted((a, b) for a, b in KNOWN_EDGES if b not in graph.get(a, set()))
    assert gone == [], f"drop these from KNOWN_EDGES: {gone}"


def test_the_cost_model_sits_at_the_bottom_layer():
    graph = import_graph()
    reach, todo = set(), ["pipeline.costs"]
    while todo:
        for b in graph[todo.pop()]:
            if b not in reach:
                reach.add(b)
                todo.append(b)
    allowed = ("pipeline.models", "pipeline.decoding", "pipeline.prompts")
    direct = {b for b in graph["pipeline.costs"] if b != "pipeline"}
    assert direct and all(b.startswith(("pipeline.models", "pipeline.decoding")) for b in direct), direct
    above = sorted(b for b in reach if b != "pipeline" and not b.startswith(allowed))
    assert above == [], f"pipeline.costs reaches modules above its layer: {above}"
    loaded = subprocess.run([sys.executable, "-c", "import sys, pipeline.costs; "
                             "print(' '.join(sorted(m for m in sys.modules if m.startswith('pipeline'))))"],
                            cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert loaded == ["pipeline", "pipeline.costs"]

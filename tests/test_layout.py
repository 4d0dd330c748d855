"""The package's layering (issues 23 and 33): stage entry points stay thin and no module grows past 600 lines, no module
imports a stage, no module imports a higher layer (``LAYERS``), the model layer imports nothing above it, the cost
model sits at the bottom layer, and there is no import circle. Read from the source (ast), so imports inside functions
count too."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from pipeline import PROJECT_ROOT

PACKAGE = PROJECT_ROOT / "pipeline"
STAGES = {"label", "dataset", "train", "evaluate", "serve", "draft", "bench_label", "bench_serve", "bench_step", "bench_batch",
          "retest"}
ENTRY_POINT_MAX_LINES = 250
FILE_MAX_LINES = 600  # any module of the package


def modules() -> dict[str, Path]:
    """``{dotted module name: file}`` of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PROJECT_ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imported(path: Path, top_level_only: bool = False) -> set[str]:
    """The ``pipeline`` modules ``path`` imports (``from pipeline.x import y`` counts ``pipeline.x`` and, when it is
    a module, ``pipeline.x.y``)."""
    known = modules()
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else ast.walk(tree)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("pipeline")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("pipeline") and node.level == 0:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in known}
    return out


def rel(path: Path) -> str:
    return str(path.relative_to(PROJECT_ROOT))


def test_stage_entry_points_are_thin():
    for stage in sorted(STAGES):
        path = PACKAGE / f"{stage}.py"
        lines = len(path.read_text().splitlines())
        assert lines < ENTRY_POINT_MAX_LINES, f"{rel(path)} has {lines} lines: move its library code into a package"


def test_no_module_imports_a_stage_entry_point():
    stages = {f"pipeline.{s}" for s in STAGES}
    found = []
    for name, path in modules().items():
        for target in sorted(imported(path) & stages):
            if target != name:
                found.append(f"{rel(path)} imports {target}")
    assert not found, "import the library module instead: " + "; ".join(found)


def test_the_model_layer_imports_nothing_above_it():
    above = ("pipeline.decoding", "pipeline.labeling", "pipeline.policy", "pipeline.serving", "pipeline.evaluation",
             "pipeline.drafting")
    found = [f"{rel(path)} imports {m}" for name, path in modules().items() if name.startswith("pipeline.models")
             for m in sorted(imported(path)) if m.startswith(above)]
    assert not found, "; ".join(found)


def import_graph() -> dict[str, set[str]]:
    """``{module: pipeline modules it imports}`` (a package's ``__init__`` importing its own modules is left out)."""
    graph = {name: {m for m in imported(path) if m in modules() and m != name} for name, path in modules().items()}
    return {name: {m for m in targets if not m.startswith(name + ".")} for name, targets in graph.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for name in sorted(graph):
        if name not in state and (cycle := visit(name)):
            return cycle
    return None


LAYERS = (  # bottom to top: a module may import its own layer and the layers below, never one above
    # utilities: PROJECT_ROOT and the Hydra resolver; the one atomic write (standard library); W&B tracking
    ("pipeline", "pipeline.files", "pipeline.tracking"),
    ("pipeline.costs",),  # the cost model (step time by rows, context and requests)
    # prompt sets and chat templates sit with the models: the model loader sets the tokenizer's template kwargs
    ("pipeline.models", "pipeline.prompts"),
    # the field's engines as peers: vLLM's server as a process and its settings (standard library; the launcher asks the
    # model layer for the target's folder): the eval stage's vLLM peers and the benchmarks start it; the plugin that runs
    # inside it sits higher (pipeline.integrations), in a package of its own
    ("pipeline.peers",),
    ("pipeline.decoding",),  # the speculative loop, sampling, schedules, the shared config checks
    ("pipeline.timing",),  # the measuring harness: times the loaded models' steps into the cost models
    ("pipeline.labeling", "pipeline.drafting"),  # labels; drafter training
    ("pipeline.policy",),  # the methods' registry, predictors, verify width, budget
    ("pipeline.integrations",),  # vLLM: imports the light policy and the cost model
    ("pipeline.evaluation", "pipeline.serving"),
)
"""Every other top-level module (``pipeline/<name>.py``: the stages, ``pipeline.cli``, ``pipeline.config_checks``) is an
entry point, the top layer."""
ENTRY_LAYER = len(LAYERS)

KNOWN_UPWARD_IMPORTS: set[tuple[str, str]] = set()  # (importer's package, imported package) pairs allowed for now


def layer_of(module: str) -> tuple[int, str]:
    """(layer index in ``LAYERS``, the package that places it) of a ``pipeline`` module; top-level modules not listed
    are entry points (``ENTRY_LAYER``).

    Raises:
        AssertionError: for a module of a package no layer lists (place the new package in ``LAYERS``).
    """
    best = None
    for index, packages in enumerate(LAYERS):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and (best is None or len(package) > len(best[1])):
                best = (index, package)
    if best is not None and best[1] != "pipeline":
        return best
    parts = module.split(".")
    assert len(parts) == 2 or module == "pipeline", f"{module}: place its package {'.'.join(parts[:2])} in LAYERS"
    return (0, "pipeline") if module == "pipeline" else (ENTRY_LAYER, module)


def upward_imports(graph: dict[str, set[str]], allowed: set[tuple[str, str]] = frozenset()) -> list[str]:
    """``"a imports b (layer i above layer j)"`` for every import of ``graph`` that reaches a higher layer, except the
    ``allowed`` (importer package, imported package) pairs."""
    found = []
    for name, targets in sorted(graph.items()):
        layer, package = layer_of(name)
        for target in sorted(targets):
            target_layer, target_package = layer_of(target)
            if target_layer > layer and (package, target_package) not in allowed:
                found.append(f"{name} (layer {layer}) imports {target} (layer {target_layer})")
    return found


def test_no_module_imports_a_higher_layer():
    found = upward_imports(import_graph(), KNOWN_UPWARD_IMPORTS)
    assert not found, "move the shared code down a layer, or call down instead: " + "; ".join(found)


def test_the_layer_check_finds_a_planted_upward_import():
    assert layer_of("pipeline.prompts") < layer_of("pipeline.decoding.speculative") < layer_of("pipeline.policy.registry")
    assert layer_of("pipeline.evaluate")[0] == layer_of("pipeline.cli")[0] == ENTRY_LAYER
    assert layer_of("pipeline.integrations.vllm.plugin")[0] > layer_of("pipeline.policy.budget")[0]
    assert layer_of("pipeline.peers.vllm_server")[0] < layer_of("pipeline.decoding.speculative")[0]  # the launcher below
    planted = {"pipeline.labeling.runner": {"pipeline.config_checks", "pipeline.decoding.speculative"},
               "pipeline.models.loading": {"pipeline.prompts", "pipeline.tracking"},
               "pipeline.costs": {"pipeline.models.target"}}
    assert upward_imports(planted, {("pipeline.costs", "pipeline.models")}) == [
        f"pipeline.labeling.runner (layer {layer_of('pipeline.labeling.runner')[0]}) imports pipeline.config_checks "
        f"(layer {ENTRY_LAYER})"]
    assert len(upward_imports(planted)) == 2  # the cost model's planted import too, once not allowed


def test_the_walk_reads_imports_and_finds_a_planted_cycle():
    graph = import_graph()
    assert "pipeline.costs" in graph["pipeline.labeling.oracle"]  # a module-level import
    assert "pipeline.timing.steps" in graph["pipeline.serve"]  # an import inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle():
    """Not even through an import inside a function (a circle the first call would otherwise close)."""
    cycle = find_cycle(import_graph())
    assert cycle is None, "break the circle by moving the shared code down a layer: " + " -> ".join(cycle)


def test_no_module_is_over_600_lines():
    long = {rel(p): n for p in modules().values() if (n := len(p.read_text().splitlines())) > FILE_MAX_LINES}
    assert not long, f"split these by role: {long}"


def test_the_cost_model_sits_at_the_bottom_layer():
    """``pipeline.costs`` imports no other module of the package but the bottom layer's standard-library utilities
    (``pipeline.files``; the measuring harness is ``pipeline.timing``), and importing it, its cache included, loads
    neither torch nor transformers (the vLLM plugin reads it in vLLM's own process)."""
    utilities = {"pipeline", "pipeline.files"}
    graph = import_graph()
    reach, todo = set(), [m for m in graph if m == "pipeline.costs" or m.startswith("pipeline.costs.")]
    while todo:
        for b in graph[todo.pop()]:
            if b not in reach:
                reach.add(b)
                todo.append(b)
    above = sorted(b for b in reach if b not in utilities and not b.startswith("pipeline.costs"))
    assert above == [], f"pipeline.costs reaches modules above its layer: {above}"
    loaded = subprocess.run([sys.executable, "-c", "import sys, pipeline.costs, pipeline.costs.store; print(' '.join("
                             "sorted(m for m in "
                             "sys.modules if m.split('.')[0] in ('pipeline', 'torch', 'transformers', 'numpy'))))"],
                            cwd=PROJECT_ROOT, capture_output=True, text=True, check=True).stdout.split()
    assert loaded and all(m in utilities or m.startswith("pipeline.costs") for m in loaded), loaded


def test_config_checks_import_no_torch_or_lightning():
    """Every stage's configuration check runs before any model loads, so a bad value fails in a second: the checks
    (``pipeline.config_checks`` and every ``checks`` module) import neither torch, Lightning nor transformers."""
    modules = ["pipeline.config_checks"] + sorted(
        "pipeline." + ".".join(p.relative_to(PROJECT_ROOT / "pipeline").with_suffix("").parts)
        for p in (PROJECT_ROOT / "pipeline").rglob("checks.py"))
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PROJECT_ROOT, check=True)
    assert len(modules) >= 6
    assert out.stdout.strip() == "[]", f"a config check imports {out.stdout.strip()}"


# -- one home per concept (issue 41): the scheduler and the per-request lifecycle ---------------------------------------
LIFECYCLE_FIELDS = {"decode_ms", "first_token_s", "finished_s", "first_block_size", "schedule_ms"}
LIFECYCLE_LISTS = {"output_ids", "token_times", "verify_widths", "confidences"}


def concept_sites(source: str) -> set[str]:
    """What a module's source does that belongs to one home only: ``scheduler`` (defines a ``*Scheduler`` class or
    ``decode_all``, walks a chunked prefill ``prefill_steps``, admits with ``add(..., load=...)``) and ``lifecycle``
    (sets a request's timing fields or appends to its output lists, defines ``cut_at_stop``)."""
    sites = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef) and node.name.endswith("Scheduler"):
            sites.add("scheduler")
        elif isinstance(node, ast.FunctionDef) and node.name in ("decode_all", "cut_at_stop"):
            sites.add("scheduler" if node.name == "decode_all" else "lifecycle")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            name, owner = node.func.attr, node.func.value
            if name == "prefill_steps" or (name == "add" and any(k.arg == "load" for k in node.keywords)):
                sites.add("scheduler")
            if name in ("append", "extend") and isinstance(owner, ast.Attribute) and owner.attr in LIFECYCLE_LISTS:
                sites.add("lifecycle")
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for leaf in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(leaf, ast.Attribute) and leaf.attr in LIFECYCLE_FIELDS:
                        sites.add("lifecycle")
    return sites


HOMES = {"scheduler": {"pipeline.decoding.scheduler"}, "lifecycle": {"pipeline.decoding.requests"}}
HOMES_ALSO = {"pipeline.decoding.speculative": {"scheduler"}}  # ``prefill`` walks its own ``prefill_steps``


def misplaced(sources: dict[str, str]) -> list[str]:
    """``"module: concept"`` for each module that does a one-home concept outside its home."""
    found = []
    for name, source in sorted(sources.items()):
        for concept in sorted(concept_sites(source) - HOMES_ALSO.get(name, set())):
            if name not in HOMES[concept]:
                found.append(f"{name}: {concept} (its home: {', '.join(sorted(HOMES[concept]))})")
    return found


def test_one_scheduler_and_one_request_lifecycle():
    """The server's engine and ``bench_batch`` run the one scheduler (``pipeline.decoding.scheduler``); the batch-1 and
    batched decoders keep each request's books through the one ``Request`` (``pipeline.decoding.requests``)."""
    sources = {name: path.read_text() for name, path in modules().items()}
    assert not misplaced(sources), "use the one home instead: " + "; ".join(misplaced(sources))
    for name in ("pipeline.decoding.speculative", "pipeline.decoding.batched"):
        assert "Request.begin(" in sources[name] and ".record(" in sources[name], f"{name} keeps its own books"
    for name in ("pipeline.serving.engine", "pipeline.evaluation.batched"):
        assert "pipeline.decoding.scheduler" in imported(modules()[name]), f"{name} does not run the one scheduler"


def test_the_home_check_finds_a_planted_second_scheduler_and_loop():
    planted = {"pipeline.serving.engine": "class Admission:\n    def go(self, d):\n        self.steps = d.prefill_steps(1)\n",
               "pipeline.decoding.batched": "def f(r, new):\n    r.stats.output_ids.extend(new)\n    r.finished_s = 1\n",
               "pipeline.decoding.speculative": "def g(self):\n    return self.prefill_steps(1)\n",
               "pipeline.policy.x": "class BurstScheduler:\n    pass\n"}
    assert misplaced(planted) == [
        "pipeline.decoding.batched: lifecycle (its home: pipeline.decoding.requests)",
        "pipeline.policy.x: scheduler (its home: pipeline.decoding.scheduler)",
        "pipeline.serving.engine: scheduler (its home: pipeline.decoding.scheduler)"]


# ---------------------------------------------------------------------------------------------------
# one drafting-policy core (issue 41)
# ---------------------------------------------------------------------------------------------------
CORE = "pipeline.policy.core"  # the request priors, the population average, the gate, the back-off
CORE_CLASSES = {"DraftingCore", "BackOff", "RequestState"}
MARGIN_HOME = "pipeline.costs.margin"  # GATE_MARGIN, low enough for the plugin's settings (pipeline.peers)
CORE_USERS = ("pipeline.policy.budget", "pipeline.policy.verify_width", "pipeline.integrations.vllm.policy")


def _constants(tree: ast.Module) -> set[str]:
    """The names a module assigns at its top level."""
    out = set()
    for node in tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out


def _back_off_loops(tree: ast.AST) -> int:
    """Doublings of a skip run: a ``min(...)`` that doubles something (``2 * x``) and caps it at a ``*skip*`` name."""
    found = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "min":
            inner = [n for a in node.args for n in ast.walk(a)]
            doubles = any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Mult) and 2 in
                          [getattr(n.left, "value", None), getattr(n.right, "value", None)] for n in inner)
            capped = any("skip" in (getattr(n, "id", None) or getattr(n, "attr", None) or "") for n in inner)
            found += doubles and capped
    return found


def drafting_policy_cores(sources: dict[str, str]) -> list[str]:
    """What makes a second drafting-policy core in ``{module: source}``: a core class, a margin or population-weight
    constant or a back-off doubling outside their one home, or a user of the core that does not import it."""
    found = []
    for name, source in sorted(sources.items()):
        tree = ast.parse(source)
        classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)} & CORE_CLASSES
        if classes and name != CORE:
            found.append(f"{name} defines {sorted(classes)} (the core's: {CORE})")
        margins = {c for c in _constants(tree) if c.endswith("MARGIN")}
        if margins and name != MARGIN_HOME:
            found.append(f"{name} defines {sorted(margins)} (import {MARGIN_HOME}.GATE_MARGIN)")
        if "POPULATION_WEIGHT" in _constants(tree) and name != CORE:
            found.append(f"{name} defines POPULATION_WEIGHT (the core's: {CORE})")
        if _back_off_loops(tree) and name != CORE:
            found.append(f"{name} doubles a skip run itself (use {CORE}.BackOff)")
    return found


def test_one_drafting_policy_core():
    """The registry's ``verify_width`` and ``budget`` and the vLLM plugin's policy call one core
    (``pipeline.policy.core``): no module but it defines its classes, the population weight or a back-off doubling, no
    module but ``pipeline.costs.margin`` a margin constant, and each of the three imports the core."""
    all_modules = modules()
    found = drafting_policy_cores({name: path.read_text() for name, path in all_modules.items()})
    assert not found, "; ".join(found)
    assert {c for c in _constants(ast.parse(all_modules[MARGIN_HOME].read_text())) if c.endswith("MARGIN")} == \
        {"GATE_MARGIN"}
    for user in CORE_USERS:
        assert CORE in imported(all_modules[user]), f"{user} must call the drafting-policy core {CORE}"
    assert layer_of(CORE)[0] < layer_of("pipeline.integrations.vllm.policy")[0]  # the plugin may import it
    assert layer_of(MARGIN_HOME)[0] < layer_of("pipeline.peers.vllm_settings")[0]  # the settings' default too


def test_the_core_check_finds_planted_copies():
    """The check finds each kind of copy the drifted cores had (issue 41)."""
    planted = {
        "pipeline.policy.budget": "GATE_MARGIN = 0.1\n",
        "pipeline.peers.vllm_settings": "DEFAULT_MARGIN = 0.1\n",
        "pipeline.integrations.vllm.policy": "POPULATION_WEIGHT = 0.1\nclass BackOff:\n    pass\n",
        "pipeline.policy.verify_width": "def next(self):\n    self.run = min(max(1, 2 * self.run), self.max_skip)\n",
        "pipeline.policy.other": "def plan(self):\n    self._probe_after = min(2 * self._probe_after, self.max_skip)\n",
        CORE: "POPULATION_WEIGHT = 0.1\nclass BackOff:\n    def missed(self):\n"
              "        self.run = min(max(1, 2 * self.run), self.max_skip)\n",
    }
    found = drafting_policy_cores(planted)
    assert len(found) == 6 and not [f for f in found if f.startswith(CORE + " ")], found
    assert drafting_policy_cores({"pipeline.x": "y = min(2 * a, b)\nz = min(max(1, 2 * n), limit)\n"}) == []

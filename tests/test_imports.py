"""The package's layering: every import points down (or sideways within a level).

Levels, lowest first. A module may import modules of its own level or below, never
above, and the package's import graph has no cycles. Function-level (lazy) imports
count too. A new module must be given a level here.
"""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eqx_tx")

LEVELS = [
    # helpers with no model knowledge, and how a model is run
    ["eqx_tx._log", "eqx_tx.util", "eqx_tx.fileio", "eqx_tx.tree", "eqx_tx.compute", "eqx_tx.batch", "eqx_tx.flops"],
    # the sharding rule table and mesh, process-level facts
    ["eqx_tx.sharding", "eqx_tx.distributed"],
    # parameter-free computations: attention kernels and their dispatch, grouped matmuls
    ["eqx_tx.kernels"],
    # modules with parameters
    ["eqx_tx.layers"],
    # model families and named configurations
    ["eqx_tx.models", "eqx_tx.presets"],
    # running and storing one model
    ["eqx_tx.hf_params", "eqx_tx.forward", "eqx_tx.loss", "eqx_tx.policy", "eqx_tx.bank_optimizer", "eqx_tx.token_budget", "eqx_tx.sampling",
     "eqx_tx.loading", "eqx_tx.saving", "eqx_tx.adapters", "eqx_tx.data", "eqx_tx.hlo", "eqx_tx.memory_figures", "eqx_tx.remat_auto", "eqx_tx.chat", "eqx_tx.page_pool",
     "eqx_tx.text"],
    # training and generation, their checkpoints, RL rollouts
    ["eqx_tx.training", "eqx_tx.generation", "eqx_tx.engine", "eqx_tx.server", "eqx_tx.checkpoint", "eqx_tx.rl"],
    # compile-time analysis of the jitted workflows
    ["eqx_tx.memory"],
    # the public API
    ["eqx_tx"],
]


def _modules() -> dict[str, str]:
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


def _level(module: str) -> int:
    best = None
    for i, prefixes in enumerate(LEVELS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), i)
    if best is None:
        raise AssertionError(f"{module} has no level in tests/test_imports.py LEVELS")
    return best[1]


def _imports(module: str, path: str, known: set[str]) -> set[str]:
    tree = ast.parse(open(path).read(), path)
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                stem = ".".join(base + ([node.module] if node.module else []))
            else:
                stem = node.module or ""
            # `from .x import y` may import the module `x.y` or a name in `x`.
            names = [f"{stem}.{a.name}" if f"{stem}.{a.name}" in known else stem for a in node.names]
        else:
            continue
        out.update(n for n in names if n == "eqx_tx" or n.startswith("eqx_tx."))
    return {n for n in out if n in known}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    known = set(modules)
    return {m: _imports(m, p, known) - {m} for m, p in modules.items()}


def test_every_import_points_down():
    upward = []
    for module, deps in sorted(_graph().items()):
        for dep in sorted(deps):
            if _level(dep) > _level(module):
                upward.append(f"{module} (level {_level(module)}) imports {dep} (level {_level(dep)})")
    assert not upward, "imports pointing up:\n" + "\n".join(upward)


def test_no_import_cycles():
    graph = _graph()
    state: dict[str, int] = {}

    def visit(node, stack):
        state[node] = 1
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep, stack + [dep])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])


def test_the_checker_sees_an_upward_import(tmp_path):
    """The walk resolves relative imports: a layer importing the models is caught."""
    path = tmp_path / "attention.py"
    path.write_text("from ..models import CausalLM\nfrom ..kernels.flash import flash_attention\n")
    known = set(_modules())
    deps = _imports("eqx_tx.layers.attention", str(path), known)
    assert deps == {"eqx_tx.models", "eqx_tx.kernels.flash"}
    assert _level("eqx_tx.models") > _level("eqx_tx.layers.attention")

"""The package's layering: subsystems, and every import pointing down.

`SUBSYSTEMS` lists every module of the package by its exact name, subsystem by
subsystem, lowest level first. A module may import modules of its own subsystem or of
a lower level, never of a higher level nor of another subsystem on its own level (the
service subsystems `io`, `train` and `infer` know nothing of each other), and the
import graph has no cycles. Function-level (lazy) imports count too. A module that is
not listed fails the test: every new module is given its place here.
"""

import ast
import os

import pytest

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "eqx_tx")


def _names(package: str, *modules: str) -> tuple[str, ...]:
    return (package,) + tuple(f"{package}.{m}" for m in modules)


# Levels, lowest first; each level maps a subsystem to its modules.
SUBSYSTEMS: list[dict[str, tuple[str, ...]]] = [
    {"core": _names("eqx_tx.core", "log", "util", "fileio", "tree", "compute", "sharding", "distributed", "flops", "runlog",
                    "ragged", "hlo", "memory_figures")},
    {"kernels": _names("eqx_tx.kernels", "mask", "quantized", "flash", "ring", "splash", "sdpa", "shared_prefix",
                       "paged", "decode_tpu", "dispatch", "grouped_ffn", "topk")},
    {"cache": _names("eqx_tx.cache", "storage", "base", "dense", "shared_prefix", "paged", "allocate")},
    {"layers": _names("eqx_tx.layers", "linear", "norm", "rope", "inputs", "attention", "mlp", "moe", "block",
                      "lora")},
    {"models": _names("eqx_tx.models", "config", "transformer", "llama", "qwen2", "qwen3", "qwen3_moe", "presets")},
    {
        "io": _names("eqx_tx.io", "hf_params", "loading", "saving", "adapters"),
        "train": _names("eqx_tx.train", "batch", "data", "token_budget", "forward", "loss", "policy",
                        "bank_optimizer", "remat_auto", "training", "checkpoint", "objectives", "bank_training"),
        "infer": _names("eqx_tx.infer", "chat", "sampling", "text", "page_pool", "config", "steps", "scheduler",
                        "runner", "generation", "engine", "prompt_scores"),
    },
    {
        "rl": _names("eqx_tx.rl", "rollouts"),
        "serve": _names("eqx_tx.serve", "loop", "metrics", "openai", "auth", "tinker_config", "tinker_wire",
                        "tinker_store", "tinker_futures", "tinker_service", "tinker_api"),
        "analysis": _names("eqx_tx.analysis", "host_memory", "memory"),
    },
    # the tools' entry point
    {"cli": ("eqx_tx.cli",)},
    # the public API
    {"api": ("eqx_tx",)},
]
PLACE = {m: (level, subsystem) for level, group in enumerate(SUBSYSTEMS) for subsystem, ms in group.items() for m in ms}


def _modules() -> dict[str, str]:
    found = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
                found[rel.removesuffix(".__init__")] = path
    return found


def _place(module: str) -> tuple[int, str]:
    if module not in PLACE:
        raise AssertionError(f"{module} has no place in tests/test_imports.py SUBSYSTEMS")
    return PLACE[module]


def _allowed(module: str, dep: str) -> bool:
    (level, subsystem), (dep_level, dep_subsystem) = _place(module), _place(dep)
    return dep_subsystem == subsystem or dep_level < level


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


def test_every_module_has_a_place():
    """Exactly the package's modules are listed: none missing, none stale."""
    modules = set(_modules())
    assert sorted(modules - set(PLACE)) == [], "modules without a place in SUBSYSTEMS"
    assert sorted(set(PLACE) - modules) == [], "SUBSYSTEMS lists modules that do not exist"


def test_every_import_points_down():
    wrong = []
    for module, deps in sorted(_graph().items()):
        for dep in sorted(deps):
            if not _allowed(module, dep):
                wrong.append(f"{module} {_place(module)} imports {dep} {_place(dep)}")
    assert not wrong, "imports pointing up or across:\n" + "\n".join(wrong)


def _private_uses(path: str) -> list[str]:
    """The `_private` names a file takes from eqx_tx: imported (`from eqx_tx.x import
    _y`), or read off a name it imported from eqx_tx (`generation._y`)."""
    tree = ast.parse(open(path).read(), path)
    imported, found = set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("eqx_tx")):
            found += [a.name for a in node.names if a.name.startswith("_")]
            imported |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            imported |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("eqx_tx")}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in imported
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{node.value.id}.{node.attr}")
    return found


def test_no_private_names_cross_modules():
    """No module takes another module's `_private` name (tools and benchmarks too)."""
    root = os.path.dirname(PACKAGE)
    found = []
    for folder in ("eqx_tx", "tools", "benchmarks"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                if name.endswith(".py"):
                    path = os.path.join(dirpath, name)
                    found += [f"{os.path.relpath(path, root)}: {use}" for use in _private_uses(path)]
    assert not found, "private names taken across modules:\n" + "\n".join(found)


def test_the_checker_sees_a_private_attribute(tmp_path):
    path = tmp_path / "bench.py"
    path.write_text("from eqx_tx.infer import generation\nimport eqx_tx\n"
                    "generation._plan()\neqx_tx._x\ngeneration.plan_requests()\ngeneration.__doc__\n")
    assert sorted(_private_uses(str(path))) == ["eqx_tx._x", "generation._plan"]


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
    assert not _allowed("eqx_tx.layers.attention", "eqx_tx.models")
    assert _allowed("eqx_tx.layers.attention", "eqx_tx.kernels.flash")


def test_the_checker_refuses_arrows_between_service_subsystems():
    assert not _allowed("eqx_tx.train.training", "eqx_tx.infer.sampling")
    assert not _allowed("eqx_tx.infer.engine", "eqx_tx.io.loading")
    assert _allowed("eqx_tx.serve.openai", "eqx_tx.infer.engine")


def test_an_unlisted_module_fails():
    with pytest.raises(AssertionError, match="no place"):
        _place("eqx_tx.somewhere_new")

"""Architecture rules that fail on regressions: no import cycles among halfprec modules, no reaches into another
object's private attributes, and ``tests/`` mirroring ``src/`` one module to one test file."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "halfprec"
TESTS = ROOT / "tests"


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for every module of the package (``halfprec.optim`` is ``optim/__init__.py``)."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = ("halfprec", *path.relative_to(SRC).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = _modules()


# --- 1. no import cycles ---------------------------------------------------------------------------------------
def _import_nodes(tree: ast.Module):
    """Every import statement, inside functions and classes too (a function-local import that closes a cycle is
    still a cycle: the modules cannot be understood, tested or moved apart), except under ``if TYPE_CHECKING:``."""
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            todo.extend(node.orelse)
        else:
            todo.extend(ast.iter_child_nodes(node))


def _imports(name: str, path: Path, source: str | None = None) -> set[str]:
    """The halfprec modules ``name`` imports anywhere (``from .x import y`` -> ``x``, or ``x.y`` when ``y`` is a
    module); ``source``: the module's text, if not the file's."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _import_nodes(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            # a submodule (``from . import checkpoint``) or a name from the package's ``__init__``
            targets = [
                f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names
            ]
        out.update(t for t in targets if t in MODULES and t != name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    cycles = _cycles(graph)
    detail = [
        " <-> ".join(c) + ": " + "; ".join(f"{m} imports {sorted(graph[m] & set(c))}" for m in c)
        for c in cycles
    ]
    assert not cycles, (
        "import cycles among halfprec modules (make one import lazy, or move the shared part):\n"
        + ("\n".join(detail))
    )


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_cycle_finder_counts_a_planted_function_local_import():
    # optim/base.py importing the factory inside a method (base -> select -> base) is found
    planted = "import torch\n\nclass A:\n    def f(self):\n        from .select import build\n        return build\n"
    base = MODULES["halfprec.optim.base"]
    found = _imports("halfprec.optim.base", base, planted)
    assert found == {"halfprec.optim.select"}
    graph = {name: _imports(name, path) for name, path in MODULES.items()}
    graph["halfprec.optim.base"] = graph["halfprec.optim.base"] | found
    assert any({"halfprec.optim.base", "halfprec.optim.select"} <= set(c) for c in _cycles(graph))
    hidden = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .select import build\n"
    assert _imports("halfprec.optim.base", base, hidden) == set()  # type-only imports run nothing


# --- 2. no private-attribute reaches ------------------------------------------------------------------------------
# ``x._name`` where ``x`` is not ``self``, ``cls``, ``super()`` or the enclosing class: allowed only for third-party
# or torch internals that have no public API (checked against torch 2.13, accelerate 1.16, lightning 2.6).
ALLOWED = {
    # torch.Tensor's version counter: the only way to tell a grad written in place since a mark (torch has
    # torch.autograd.graph.increment_version, no public reader)
    "_version": "torch.Tensor._version",
    # torch's foreach kernels are only exposed as torch._foreach_*; torch.optim itself calls them
    "_foreach_copy_": "torch._foreach_copy_",
    "_foreach_mul_": "torch._foreach_mul_",
    # the autograd engine's end-of-backward callback; torch.autograd.graph.queue_callback was proposed
    # (pytorch/pytorch#66199, PR #193958) and is not in torch 2.13
    "_execution_engine": "torch.autograd.Variable._execution_engine",
    # torch.optim.Optimizer keeps its step hooks in these dicts; there are register_* methods but no reader
    "_optimizer_step_pre_hooks": "torch.optim.Optimizer._optimizer_step_pre_hooks",
    "_optimizer_step_post_hooks": "torch.optim.Optimizer._optimizer_step_post_hooks",
    # the global step hooks (torch.optim.optimizer.register_optimizer_step_pre_hook / _post_hook) live in these
    # module dicts; torch has no reader, and MixedPrecisionOptimizer.step runs them as torch's step wrapper does
    "_global_optimizer_pre_hooks": "torch.optim.optimizer._global_optimizer_pre_hooks",
    "_global_optimizer_post_hooks": "torch.optim.optimizer._global_optimizer_post_hooks",
    # whether a profiler is recording: torch's profiler has no public query; MixedPrecisionOptimizer.step opens its
    # profiler range only then (an idle range costs two dispatcher calls of host time on every step)
    "_profiler_enabled": "torch.autograd._profiler_enabled",
    # accelerate.Accelerator keeps the prepared optimizers here; it has no public list of them
    "_optimizers": "accelerate.Accelerator._optimizers",
    # AcceleratedOptimizer.step_was_skipped is a read-only property over this flag, set only by Accelerate's own
    # GradScaler; halfprec sets it so the Trainer and the AcceleratedScheduler see its skips
    "_is_overflow": "accelerate.optimizer.AcceleratedOptimizer._is_overflow",
    # torch's LR schedulers warn "lr_scheduler.step() before optimizer.step()" unless their wrapper of step() set
    # this flag; a fused step replaces step() without calling it, and torch has no public way to set it
    "_opt_called": "torch.optim.Optimizer._opt_called",
    # Lightning's and Fabric's optimizer wrappers subclass the wrapped optimizer's class on the fly, so isinstance
    # cannot tell them from a MixedPrecisionOptimizer, and their public .optimizer has the name of
    # MixedPrecisionOptimizer.optimizer (the inner torch optimizer): only this attribute is theirs alone
    "_optimizer": "lightning LightningOptimizer/_FabricOptimizer._optimizer",
    # the op GradScaler.unscale_ runs: the benchmark's torch-AMP baseline times it without a GradScaler's
    # per-optimizer bookkeeping, as torch.optim's fused kernels are fed
    "_amp_foreach_non_finite_check_and_unscale_": "torch._amp_foreach_non_finite_check_and_unscale_",
}


def _is_private(attr: str) -> bool:
    return attr.startswith("_") and not (attr.startswith("__") and attr.endswith("__"))


def _is_own(value: ast.expr, classes: list[str]) -> bool:
    """``self``, ``cls``, ``super()``, ``type(self)`` or the name of the class the code is in."""
    if isinstance(value, ast.Name):
        return value.id in ("self", "cls") or value.id in classes
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name):
        return value.func.id == "super" or (value.func.id == "type" and ast.unparse(value) == "type(self)")
    return False


def _reaches(tree: ast.AST, classes: tuple[str, ...] = ()) -> list[tuple[int, str]]:
    out = []
    for node in ast.iter_child_nodes(tree):
        inner = (*classes, node.name) if isinstance(node, ast.ClassDef) else classes
        if (
            isinstance(node, ast.Attribute)
            and _is_private(node.attr)
            and not _is_own(node.value, list(classes))
        ):
            out.append((node.lineno, ast.unparse(node)))
        out.extend(_reaches(node, inner))
    return out


def _all_reaches() -> list[tuple[str, int, str]]:
    return [
        (str(path.relative_to(SRC)), line, expr)
        for path in MODULES.values()
        for line, expr in _reaches(ast.parse(path.read_text()))
    ]


def test_no_private_attribute_reaches():
    bad = [
        f"src/halfprec/{file}:{line}: {expr}"
        for file, line, expr in _all_reaches()
        if expr.rpartition(".")[2] not in ALLOWED
    ]
    assert not bad, (
        "reaches into another object's private attribute (give the owner a public method or property; only "
        "third-party internals with no public API go in ALLOWED, each with why):\n" + "\n".join(sorted(bad))
    )


def test_reach_finder():
    code = (
        "class A:\n"
        "    def f(self, other):\n"
        "        self._x; super()._y; type(self)._z; A._w; other.__dict__\n"
        "        return other._secret, self._inner._secret\n"
    )
    assert [e for _, e in _reaches(ast.parse(code))] == ["other._secret", "self._inner._secret"]


# --- 3. tests/ mirrors src/ ----------------------------------------------------------------------------------
# Modules that need no test file of their own. ``__init__`` modules are all re-exports (their public surface is
# pinned by tests/test_import.py and by the tests of what they re-export).
EXEMPT = {
    "kernels/settings.py": "launch-settings table (block sizes, warps); every kernel test runs through it",
}

# Modules whose tests live in a file that does not mirror them: (test files, why). The multi-process tests stay in
# tests/distributed/, beside the launcher and worker (_launch.py, _worker.py) whose shared launches they read. The
# LAMB kernel, the fused skip log and fused Adagrad are tested through the fused optimizers' parity harness in
# tests/optim/fused/, which compares a whole fused step with the exact path's.
ELSEWHERE = {
    "checkpoint/consolidate.py": (
        ["tests/distributed/test_checkpoint.py", "tests/checkpoint/test_safe_dcp.py"],
        "multi-process checkpoints; single-process reads beside the safe reader",
    ),
    "checkpoint/dcp.py": (["tests/distributed/test_checkpoint.py"], "multi-process checkpoints"),
    "prepare.py": (
        ["tests/distributed/test_engine_fsdp.py", "tests/test_engine.py"],
        "through the engine: FSDP2 needs several ranks, the cast of the rest runs in every engine test",
    ),
    "kernels/lamb.py": (["tests/optim/fused/test_lamb.py"], "through FusedLamb against the reference LAMB"),
    "optim/fused/results.py": (["tests/optim/fused/test_base.py"], "the fused skip log and device results"),
    "optim/fused/adagrad.py": (["tests/optim/fused/test_sgd.py"], "beside SGD: the same parity harness"),
    "optim/sharded/checks.py": (["tests/distributed/test_errors.py"], "multi-process tests"),
    "optim/sharded/fused_step.py": (["tests/distributed/test_fused.py"], "multi-process tests"),
    "optim/sharded/grads.py": (
        [
            "tests/distributed/test_surface.py",
            "tests/distributed/test_sharded.py",
            "tests/distributed/test_raised.py",
        ],
        "same",
    ),
    "optim/sharded/optimizer.py": (["tests/distributed/test_sharded.py"], "multi-process tests"),
}


def mirror(path: Path) -> Path:
    """``src/halfprec/a/b.py`` -> ``tests/a/test_b.py`` (a leading underscore dropped: ``_checks`` -> ``test_checks``)."""
    rel = path.relative_to(SRC)
    return TESTS / rel.parent / f"test_{rel.stem.lstrip('_')}.py"


def mirror_map() -> dict[str, str]:
    """Every module -> where its tests are (or why it needs none)."""
    out = {}
    for path in MODULES.values():
        rel = str(path.relative_to(SRC))
        if path.name == "__init__.py":
            out[rel] = "(re-exports)"
        elif rel in EXEMPT:
            out[rel] = f"(exempt: {EXEMPT[rel]})"
        elif mirror(path).exists():
            out[rel] = str(mirror(path).relative_to(ROOT))
        elif rel in ELSEWHERE:
            out[rel] = ", ".join(ELSEWHERE[rel][0]) + " (tested elsewhere)"
        else:
            out[rel] = "MISSING " + str(mirror(path).relative_to(ROOT))
    return out


def test_tests_mirror_src():
    table = mirror_map()
    missing = [f"src/halfprec/{m}: {where}" for m, where in table.items() if where.startswith("MISSING")]
    assert not missing, (
        "modules without a mirroring test file (write it, or name where they are tested):\n"
        + ("\n".join(missing))
    )


def test_exemptions_name_real_files_and_modules():
    for rel in (*EXEMPT, *ELSEWHERE):
        assert (SRC / rel).is_file(), f"{rel} is no module of src/halfprec: drop it from the exemptions"
    for rel, (files, _why) in ELSEWHERE.items():
        assert not mirror(SRC / rel).exists(), (
            f"{rel} has its mirroring test file now: drop it from ELSEWHERE"
        )
        for file in files:
            assert (ROOT / file).is_file(), f"{rel} is said to be tested in {file}, which does not exist"

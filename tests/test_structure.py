"""The package's shape: imports go one way, modules do not import each other in a circle, a
function-local import of `titans` says why it is local, and the memory op (`titans.ops.memory`) is reached
through its entry point, its rule parts refused without their maths.

Every module under src/titans is read with `ast` (nothing is imported), top-level and function-local imports
alike. Package order, lower first (a module may import its own level and lower ones, never a higher one):

    ops, data, validation, _fs < layers < models < runtime
    < training, inference, hf, forecast, dna < evaluation < serving < cli, demo, __main__, lm_eval, titans

`titans.runtime` holds what both training and inference need (the device, checkpoints, loading a trained
model, sampling defaults), so those two never import each other, in either direction (`APART`).
`titans.hf` wraps models for `transformers` (beside training and inference); the root package
`titans/__init__.py` only re-exports public names, so nothing inside the package imports from it.
"""

from __future__ import annotations

import ast
import io
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "titans"

TOP = 7
LEVELS = {
    "ops": 0,
    "data": 0,
    "validation": 0,
    "_fs": 0,  # file modes, used by data, models, training and inference
    "layers": 1,
    "models": 2,
    "runtime": 3,  # device, checkpoints, loading a trained model, sampling defaults
    "training": 4,
    "inference": 4,
    "hf": 4,
    "forecast": 4,  # time-series forecasting on the model blocks
    "dna": 4,  # DNA language modelling and classification (uses the trainer)
    "evaluation": 5,
    "serving": 6,  # the HTTP server over inference; only the CLI above it
    "cli": TOP,
    "demo": TOP,
    "__main__": TOP,
    "lm_eval": TOP,  # `python -m titans.lm_eval`: lm-eval's command line with the titans model type
}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str  # a module of the package
    line: int
    end_line: int
    local: bool  # inside a function body (runs on call, not on import)
    type_only: bool  # under `if TYPE_CHECKING:`


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def level(module: str) -> int:
    parts = module.split(".")
    return TOP if len(parts) == 1 else LEVELS[parts[1]]


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def read_imports(source: str, importer: str, modules: set[str], *, is_package: bool = False) -> list[Import]:
    """The imports of one module's source that name modules in ``modules`` (``from P import m`` names the
    submodule ``P.m`` when there is one, else ``P``)."""
    found: list[Import] = []

    def target_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    def visit(node: ast.AST, local: bool, type_only: bool) -> None:
        targets: list[str | None] = []
        if isinstance(node, ast.Import):
            targets = [target_of(a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, is_package, node)
            targets = [target_of(f"{base}.{a.name}") or target_of(base) for a in node.names]
        for target in dict.fromkeys(t for t in targets if t is not None and t != importer):
            found.append(Import(importer, target, node.lineno, node.end_lineno, local, type_only))
        for child in ast.iter_child_nodes(node):
            child_local = local or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            child_type_only = type_only or (
                isinstance(node, ast.If) and _is_type_checking(node.test) and child in node.body
            )
            visit(child, child_local, child_type_only)

    visit(ast.parse(source), False, False)
    return found


def comment_lines(source: str) -> set[int]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return {t.start[0] for t in tokens if t.type == tokenize.COMMENT}


def package_imports() -> tuple[list[Import], dict[str, set[int]]]:
    files = sorted(PACKAGE.rglob("*.py"))
    modules = {module_name(f, PACKAGE): f for f in files}
    imports: list[Import] = []
    comments: dict[str, set[int]] = {}
    for name, path in modules.items():
        source = path.read_text(encoding="utf-8")
        imports += read_imports(source, name, set(modules), is_package=path.name == "__init__.py")
        comments[name] = comment_lines(source)
    return imports, comments


# packages of one level that import nothing of each other, in either direction
APART = {frozenset({"training", "inference"})}


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward(imports: list[Import]) -> set[tuple[str, str]]:
    return {(i.importer, i.target) for i in imports if level(i.importer) < level(i.target)}


def across(imports: list[Import]) -> set[tuple[str, str]]:
    """Imports between two packages that are kept apart (`APART`)."""
    return {
        (i.importer, i.target)
        for i in imports
        if frozenset({package_of(i.importer), package_of(i.target)}) in APART
        and package_of(i.importer) != package_of(i.target)
    }


def cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (or a module importing itself)."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
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
            if len(component) > 1 or (v, v) in edges:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            connect(v)
    return found


IMPORTS, COMMENTS = package_imports()


def test_the_reader_sees_the_package():
    """Guards the checks below against reading nothing: imports that exist must be found, as what they are."""
    seen = {(i.importer, i.target, i.local) for i in IMPORTS}
    assert ("titans.training.trainer", "titans.training.perplexity", False) in seen
    assert ("titans.evaluation.cli", "titans.evaluation.ablation", False) in seen  # `from P import module`
    assert ("titans.cli", "titans.runtime.checkpoint", True) in seen
    assert len({i.importer for i in IMPORTS}) > 40


def test_reader_on_a_made_up_module():
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from . import b\n"
        "import pkg.c.d\n"
        "if TYPE_CHECKING:\n"
        "    from pkg.c import e\n"
        "class K:\n"
        "    from pkg.c import f\n"
        "def g():\n"
        "    # the reason\n"
        "    from pkg.c.d import name\n"
        "    return lambda: __import__('x')\n"
    )
    modules = {"pkg", "pkg.a", "pkg.b", "pkg.c", "pkg.c.d", "pkg.c.e"}
    got = {(i.target, i.line, i.local, i.type_only) for i in read_imports(source, "pkg.a", modules)}
    assert got == {
        ("pkg.b", 3, False, False),
        ("pkg.c.d", 4, False, False),
        ("pkg.c.e", 6, False, True),
        ("pkg.c", 8, False, False),  # a class body runs on import; `f` is a name in pkg.c, not a module
        ("pkg.c.d", 11, True, False),
    }
    assert comment_lines(source) == {10}
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("c", "d"), ("d", "d"), ("e", "a"), ("e", "f")}
    assert sorted(cycles(edges)) == [["a", "b", "c"], ["d"]]


def test_every_module_has_a_level():
    names = {module_name(f, PACKAGE) for f in PACKAGE.rglob("*.py")}
    missing = sorted(m for m in names if "." in m and m.split(".")[1] not in LEVELS)
    assert not missing, f"modules outside the package order (add them to LEVELS): {missing}"


def test_imports_go_one_way():
    """No module imports one of a higher package (top-level or inside a function)."""
    wrong = sorted(upward(IMPORTS))
    assert not wrong, "imports against the package order:\n" + "\n".join(f"  {a} -> {b}" for a, b in wrong)


def test_training_and_inference_import_nothing_of_each_other():
    """Neither imports the other, not even inside a function: what both need lives in `titans.runtime`
    (or lower), so either can be built, changed or left out without the other."""
    wrong = sorted(across(IMPORTS))
    assert not wrong, "imports between training and inference:\n" + "\n".join(
        f"  {a} -> {b}" for a, b in wrong
    )


def test_the_layering_checks_catch_arrows_back_up():
    """The two checks above, on made-up imports: a function-local import runs back up as much as a
    top-level one, and training -> inference is refused although both sit on one level."""
    modules = {
        "titans.training.trainer",
        "titans.inference.generation",
        "titans.runtime.device",
        "titans.models.lm",
        "titans.serving.app",
    }
    trainer = "def sample():\n    from titans.inference.generation import generate\n"
    lm = "from titans.runtime.device import resolve_device\n"
    runtime = "def load():\n    from titans.training import trainer\n"
    serving = "from titans.runtime.device import resolve_device\nfrom titans.inference import generation\n"
    imports = (
        read_imports(trainer, "titans.training.trainer", modules)
        + read_imports(lm, "titans.models.lm", modules)
        + read_imports(runtime, "titans.runtime.device", modules)
        + read_imports(serving, "titans.serving.app", modules)
    )
    assert upward(imports) == {
        ("titans.models.lm", "titans.runtime.device"),
        ("titans.runtime.device", "titans.training.trainer"),
    }
    assert across(imports) == {("titans.training.trainer", "titans.inference.generation")}


def test_runtime_helpers_have_one_home():
    """Device resolution, checkpoint reading and sampling defaults are defined in `titans.runtime` only;
    the training config takes its sampling defaults from there."""
    from titans.runtime import checkpoint, device, loading, sampling
    from titans.training import distributed
    from titans.training.config import TrainConfig

    assert distributed.resolve_device is device.resolve_device
    assert loading.load_checkpoint is checkpoint.load_checkpoint
    defaults = TrainConfig()
    assert (defaults.sample_temperature, defaults.sample_top_k) == (
        sampling.SAMPLING.temperature,
        sampling.SAMPLING.top_k,
    )
    defined = {
        (m, node.name)
        for m, path in ((module_name(p, PACKAGE), p) for p in PACKAGE.rglob("*.py"))
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.FunctionDef) and node.name in {"resolve_device", "load_checkpoint"}
    }
    assert defined == {
        ("titans.runtime.device", "resolve_device"),
        ("titans.runtime.checkpoint", "load_checkpoint"),
    }


def test_no_import_cycles():
    """Imports form no cycle, function-local ones included (a local import that breaks a cycle at import
    time leaves the modules depending on each other: `data.sources` and `data.dna` did); imports for type
    checking only never run and are left out."""
    edges = {(i.importer, i.target) for i in IMPORTS if not i.type_only}
    found = cycles(edges)
    assert not found, "import cycles:\n" + "\n".join("  " + " -> ".join(c) for c in found)


def test_local_imports_say_why():
    """A function-local import of the package is there for a reason (an optional part or dependency,
    start-up time, a cycle it breaks): a comment on its line or the line above says which."""
    silent = [
        f"  {i.importer}:{i.line} imports {i.target}"
        for i in IMPORTS
        if i.local and not COMMENTS[i.importer] & set(range(i.line - 1, i.end_line + 1))
    ]
    assert not silent, "function-local imports without a comment saying why:\n" + "\n".join(silent)


def test_references_share_no_code_with_the_fast_paths():
    """`ops/**/*_ref.py` are written from the equations: they import no module of the package, so a bug in a
    fast path cannot sit on both sides of the test that compares them."""
    refs = {m for m in {i.importer for i in IMPORTS} | set(COMMENTS) if m.endswith("_ref")}
    assert refs == {
        "titans.ops.memory.chunk_ref",
        "titans.ops.attention_ref",
        "titans.ops.conv_ref",
        "titans.ops.memory.rules_ref",
    }
    shared = sorted(f"{i.importer} -> {i.target}" for i in IMPORTS if i.importer in refs)
    assert not shared, "references importing package code:\n" + "\n".join(shared)


# the memory op's package and its one entry point
OP_PACKAGE = "titans.ops.memory"
ROOT = PACKAGE.parents[1]
# tests and benchmarks that measure or patch one path's internals (its caches, its autograd Function, its
# buffers) reach the module that holds them; every other file goes through the entry point
OP_INTERNALS_READERS = {
    "tests/test_memory_checkpointing.py": {"titans.ops.memory.chunk"},
    "tests/test_memory_triton.py": {"titans.ops.memory.triton_chunk"},
    "benchmarks/memory_kernels.py": {"titans.ops.memory.triton_chunk"},
    "benchmarks/memory_kernel_ops.py": {"titans.ops.memory.triton_chunk"},  # counts its kernel launches
    "benchmarks/kernel_resources.py": {"titans.ops.memory.triton_chunk"},  # compiles its kernels
    "benchmarks/memory_profile.py": {"titans.ops.memory.chunk"},
    "benchmarks/fused_chunk_step.py": {"titans.ops.memory.chunk"},  # switches its fused step off
}


def _op_submodule_imports(imports: list[Import]) -> list[str]:
    return sorted(
        f"  {i.importer}:{i.line} imports {i.target}"
        for i in imports
        if i.target.startswith(OP_PACKAGE + ".") and not i.importer.startswith("titans.ops.")
    )


def test_the_memory_op_is_reached_through_its_entry_point():
    """Outside `titans.ops`, the package imports `titans.ops.memory` (its `neural_memory` and the names it
    exports), never one of its modules; so do the tests and benchmarks, but for those that read one path's
    internals (OP_INTERNALS_READERS)."""
    modules = {module_name(f, PACKAGE) for f in PACKAGE.rglob("*.py")}
    assert {f"{OP_PACKAGE}.chunk", f"{OP_PACKAGE}.rules", f"{OP_PACKAGE}.chunk_ref"} <= modules
    assert OP_PACKAGE in {i.target for i in IMPORTS if i.importer == "titans.layers.memory"}
    wrong = _op_submodule_imports(IMPORTS)
    assert not wrong, "modules of the memory op imported from outside titans.ops:\n" + "\n".join(wrong)
    outside = []
    for folder in ("tests", "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found = read_imports(path.read_text(encoding="utf-8"), f"{folder}.{path.stem}", modules)
            allowed = OP_INTERNALS_READERS.get(rel, set())
            outside += [
                f"  {rel}:{i.line} imports {i.target}"
                for i in found
                if i.target.startswith(OP_PACKAGE + ".") and i.target not in allowed
            ]
    assert not outside, "modules of the memory op imported by tests or benchmarks:\n" + "\n".join(outside)


def test_the_entry_point_check_sees_a_submodule_import():
    source = "from titans.ops.memory import chunk\nfrom titans.ops.memory.rules import MemoryRule\n"
    modules = {"titans.ops.memory", "titans.ops.memory.chunk", "titans.ops.memory.rules"}
    found = read_imports(source, "titans.layers.x", modules)
    assert len(_op_submodule_imports(found)) == 2
    inside = read_imports(source, "titans.ops.memory", modules, is_package=True)
    assert not _op_submodule_imports(inside)


def test_a_part_without_its_methods_is_refused():
    """A part class must define every method of its slot where it is defined; a kind is taken once; a rule
    takes registered parts only."""
    from titans.ops.memory import (
        BIASES,
        OPTIMIZERS,
        RETENTIONS,
        Bias,
        LpBias,
        MemoryRule,
        Optimizer,
        Retention,
        RulePart,
    )

    with pytest.raises(TypeError, match=r"retention part NoRead \(kind 'toy_no_read'\) does not define read"):

        class NoRead(Retention, kind="toy_no_read"):
            pass

    with pytest.raises(TypeError, match="does not define momentum_coefficients, update"):

        class OnlyMomentum(Optimizer, kind="toy_only_momentum"):
            uses_momentum = True

    with pytest.raises(TypeError, match="does not define grad"):

        class NoGrad(Bias, kind="toy_no_grad"):
            def error_map(self, e, aux):
                return e

    assert not {"toy_no_read", "toy_only_momentum", "toy_no_grad"} & {*BIASES, *RETENTIONS, *OPTIMIZERS}
    with pytest.raises(ValueError, match="bias kind 'lp' is taken by LpBias"):

        class OtherLp(LpBias, kind="lp"):
            pass

    @dataclass(frozen=True)
    class Unregistered(Retention):  # no kind: not a part a rule can hold
        def read(self, a):
            return a

    with pytest.raises(TypeError, match="retention must be one of"):
        MemoryRule(retention=Unregistered())
    with pytest.raises(TypeError, match="derive it from Bias, Retention or Optimizer"):

        class Loose(RulePart, kind="toy_loose"):
            pass


# The one module that steps an optimizer: every training loop of the package runs on it.
TRAIN_LOOP = "titans.training.loop"


def optimizer_steps(source: str) -> list[tuple[int, str]]:
    """Where a module steps an optimizer or clips gradients: `x.step()` called without arguments (an
    optimizer's or a schedule's step; a data or world `step(...)` takes some) and `clip_grad_norm_`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        bare_step = name == "step" and isinstance(func, ast.Attribute) and not (node.args or node.keywords)
        if bare_step or name in ("clip_grad_norm_", "clip_grad_value_"):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_reader_finds_optimizer_steps():
    source = "opt.step()\nsched.step()\nworld.step({'move': 1.0})\nnn.utils.clip_grad_norm_(ps, 1.0)\n"
    assert [line for line, _ in optimizer_steps(source)] == [1, 2, 4]


def test_only_the_shared_loop_steps_an_optimizer():
    """Task training, forecasting, DNA training and the LM trainer inject their batches and loss into
    `titans.training.loop` instead of keeping loops of their own: clipping, the non-finite check, signals,
    checkpoints and progress then hold for every one of them."""
    elsewhere = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = module_name(path, PACKAGE)
        if module != TRAIN_LOOP:
            elsewhere += [f"{module}:{line}: {call}" for line, call in optimizer_steps(path.read_text())]
    assert not elsewhere, "optimizer steps outside titans.training.loop:\n" + "\n".join(elsewhere)
    assert optimizer_steps((PACKAGE / "training" / "loop.py").read_text())  # the reader sees the real one


def test_every_extra_a_message_or_page_names_exists():
    """An install hint names an extra of pyproject.toml: the essay haystack's error said `pip install
    titans[eval]`, an extra that does not exist (pip only warns and installs nothing)."""
    import re

    tomllib = pytest.importorskip("tomllib", reason="Python 3.11+")
    root = PACKAGE.parents[1]
    extras = set(tomllib.loads((root / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    files = [*PACKAGE.rglob("*.py"), *(root / "docs").glob("*.md"), root / "README.md"]
    named = {
        (f.relative_to(root).as_posix(), extra)
        for f in files
        for group in re.findall(r"titans\[([\w,-]+)\]", f.read_text())
        for extra in group.split(",")
    }
    assert named and not {(f, e) for f, e in named if e not in extras}

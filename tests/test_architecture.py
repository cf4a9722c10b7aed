"""The house: four wings, arrows pointing inward only, read off every module's imports with ``ast``.

    contract <- checks <- faces        contract <- derivations <- faces        derivations never import checks

- **contract** (schema, the document model, the one reading of the configuration, loader/writer, every edit)
  imports only the standard library, jsonschema, referencing and ruamel.yaml;
- **checks** (rules, the status ladder) imports contract; pure functions of a document (no I/O);
- **derivations** (the rooms stack, engine, resolve, estimate, measure, shard, devices, allocator) imports contract;
  the only code that imports torch & co., and only inside functions; it never touches a document's tree or plain copy
  itself;
- **faces** (the CLI, reports, status settling) may import every wing; so may the package root (``ledgerspec``,
  ``ledgerspec.__main__``), which is a face. ``ledgerspec.errors`` and ``ledgerspec.version`` sit under the
  contract: every wing may import them.

Inside a wing the arrows point one way too: no import circles (lazy imports inside functions count).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import REPO_ROOT

PACKAGE = REPO_ROOT / "ledgerspec"
WINGS = ("contract", "checks", "derivations", "faces")
#: modules below every wing
BASE = ("ledgerspec.errors", "ledgerspec.version")
#: what each wing may import from ledgerspec (besides itself and :data:`BASE`)
ALLOWED = {
    "contract": (),
    "checks": ("contract",),
    "derivations": ("contract",),
    "faces": ("contract", "checks", "derivations"),
    "root": ("contract", "checks", "derivations", "faces"),
    "base": (),
}
#: the top-level modules no wing may import except derivations, and there only inside functions
HEAVY = (
    "torch",
    "transformers",
    "peft",
    "bitsandbytes",
    "accelerate",
    "trl",
    "numpy",
    "pynvml",
    "nvidia_ml_py",
    "psutil",
)
#: the contract wing's whole outside world
CONTRACT_THIRD_PARTY = ("jsonschema", "ruamel", "referencing")


@dataclass(frozen=True)
class Import:
    module: str  # the absolute dotted name imported
    file: Path
    line: int
    nested: bool  # inside a function body (lazy), not at module level
    type_only: bool  # under ``if TYPE_CHECKING:``


def _resolve(node: ast.ImportFrom, file: Path) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        package = list(file.relative_to(PACKAGE.parent).parent.parts)  # the package holding ``file``
        parts = package[: len(package) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    # ``from ledgerspec.derivations.estimate import sweep`` imports the module ledgerspec.derivations.estimate.sweep
    return [f"{base}.{a.name}" for a in node.names] + [base]


def _imports(file: Path) -> list[Import]:
    tree = ast.parse(file.read_text(encoding="utf-8"), str(file))
    found: list[Import] = []

    def visit(node: ast.AST, nested: bool, type_only: bool) -> None:
        for child in ast.iter_child_nodes(node):
            child_nested = nested or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda)
            child_type_only = type_only or (isinstance(child, ast.If) and _is_type_checking(child.test))
            if isinstance(child, ast.Import):
                found.extend([Import(a.name, file, child.lineno, nested, type_only) for a in child.names])
            elif isinstance(child, ast.ImportFrom):
                found.extend(Import(m, file, child.lineno, nested, type_only) for m in _resolve(child, file))
            elif isinstance(child, ast.Call) and _dynamic_import(child):
                arg = child.args[0]
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    found.append(Import(arg.value, file, child.lineno, nested, type_only))
                elif isinstance(arg, ast.JoinedStr) and isinstance(arg.values[0], ast.Constant):
                    found.append(Import(str(arg.values[0].value).rstrip("."), file, child.lineno, nested, type_only))
            visit(child, child_nested, child_type_only)

    visit(tree, False, False)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _dynamic_import(call: ast.Call) -> bool:
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
    return name in ("import_module", "__import__") and bool(call.args)


def wing_of_file(file: Path) -> str:
    rel = file.relative_to(PACKAGE).parts
    if len(rel) > 1 and rel[0] in WINGS:
        return rel[0]
    return "base" if file.stem in ("errors", "version") else "root"


def wing_of_module(module: str) -> str | None:
    """The wing of an imported ``ledgerspec`` module; None for anything outside ledgerspec."""
    parts = module.split(".")
    if parts[0] != "ledgerspec":
        return None
    if module in BASE or any(module.startswith(b + ".") for b in BASE):
        return "base"
    if len(parts) > 1 and parts[1] in WINGS:
        return parts[1]
    return "root"


def _top(module: str) -> str:
    return module.split(".")[0]


MODULES = sorted(PACKAGE.rglob("*.py"))
ALL_IMPORTS = [imp for f in MODULES for imp in _imports(f)]


def _where(imp: Import) -> str:
    return f"{imp.file.relative_to(PACKAGE.parent)}:{imp.line}: {imp.module}"


def violations(imports: list[Import]) -> list[str]:
    """Every import that breaks the rule (the module docstring), as ``file:line: module``."""
    bad = []
    for imp in imports:
        src, dst = wing_of_file(imp.file), wing_of_module(imp.module)
        if dst is None or dst == "base" or dst == src:
            continue
        if dst not in ALLOWED[src]:
            bad.append(_where(imp) + f"  ({src} must not import {dst})")
    return bad


def test_the_parser_sees_nested_relative_and_dynamic_imports() -> None:
    """The checks below are only as good as this parser: nested, relative and dynamic imports are seen."""
    found = _imports(PACKAGE / "derivations" / "resolve" / "resolver.py")
    assert any(i.module.startswith("ledgerspec.contract") and not i.nested for i in found)
    assert any(_top(i.module) in HEAVY and i.nested for i in found), "resolve imports torch & co. lazily"
    schema = _imports(PACKAGE / "faces" / "commands" / "schema.py")
    assert any(i.module == "ledgerspec.contract.schema" and i.nested for i in schema)
    cli = _imports(PACKAGE / "faces" / "cli.py")
    assert any(i.module == "ledgerspec.faces.commands" for i in cli), "the f-string import_module is seen"
    tree = ast.parse("from . import units\nfrom ..errors import X\n")
    nodes = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert "ledgerspec.contract.units" in _resolve(nodes[0], PACKAGE / "contract" / "writer.py")
    assert "ledgerspec.errors" in _resolve(nodes[1], PACKAGE / "contract" / "writer.py")


@pytest.mark.parametrize(
    ("file", "module", "ok"),
    [
        ("derivations/estimate/estimator.py", "ledgerspec.checks.ladder", False),
        ("derivations/measure/measurer.py", "ledgerspec.faces.status", False),
        ("checks/ladder.py", "ledgerspec.derivations.stack.census", False),
        ("contract/config.py", "ledgerspec.checks.ladder", False),
        ("contract/config.py", "ledgerspec.errors", True),
        ("checks/rules.py", "ledgerspec.contract.config", True),
        ("derivations/stack/census.py", "ledgerspec.contract.config", True),
        ("derivations/stack/census.py", "ledgerspec.version", True),
        ("faces/commands/estimate/plain.py", "ledgerspec.checks.validate", True),
        ("__init__.py", "ledgerspec.derivations.resolve", True),
    ],
)
def test_the_rule_itself(file: str, module: str, ok: bool) -> None:
    """The rule as data: a planted import of each forbidden kind is caught, and the allowed ones pass."""
    imp = Import(module, PACKAGE / file, 1, False, False)
    assert (violations([imp]) == []) is ok


def test_every_module_follows_the_rule() -> None:
    bad = violations(ALL_IMPORTS)
    assert not bad, "imports that point outward (see this module's docstring):\n" + "\n".join(bad)


def module_name(file: Path) -> str:
    """The dotted name of the module ``file`` holds (a package's ``__init__.py`` is the package)."""
    parts = list(file.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULE_NAMES = frozenset(module_name(f) for f in MODULES)


def _loaded(name: str, modules: frozenset[str]) -> str | None:
    """The module an imported dotted name loads: itself, or the nearest package or module that defines it
    (``ledgerspec.derivations.shard.sharder.shard`` loads ``ledgerspec.derivations.shard.sharder``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(imports: list[Import], modules: frozenset[str]) -> dict[str, dict[str, list[Import]]]:
    """``{module: {module it imports: [the imports]}}`` among ``modules``. Lazy imports (inside functions) and
    dynamic ones count; ``TYPE_CHECKING`` imports do not (they never run), nor does an import of one of the module's
    own ancestor packages (Python imports a module's parent packages before the module anyway)."""
    graph: dict[str, dict[str, list[Import]]] = {m: {} for m in modules}
    for imp in imports:
        src, dst = module_name(imp.file), _loaded(imp.module, modules)
        if imp.type_only or dst is None or dst == src or src.startswith(dst + "."):
            continue
        graph.setdefault(src, {}).setdefault(dst, []).append(imp)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[Import]]]) -> list[list[str]]:
    """Tarjan's strongly connected components of ``graph``, each sorted; a component of two or more modules is a
    circle (every module in it reaches every other)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
            found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def circles(imports: list[Import], modules: frozenset[str] = MODULE_NAMES) -> list[str]:
    """Every import circle among ``modules``: its modules, then each of its edges as ``file:line: a -> b``."""
    graph = import_graph(imports, modules)
    out = []
    for component in strongly_connected(graph):
        if len(component) < 2:
            continue
        members = set(component)
        lines = [f"circle of {len(component)} modules: {', '.join(component)}"]
        for src in component:
            for dst, imps in sorted(graph[src].items()):
                if dst in members:
                    for file, line, nested in sorted({(i.file, i.line, i.nested) for i in imps}):
                        lazy = " (inside a function)" if nested else ""
                        lines.append(f"  {file.relative_to(PACKAGE.parent)}:{line}: {src} -> {dst}{lazy}")
        out.append("\n".join(lines))
    return out


def test_the_circle_detector_finds_a_planted_circle() -> None:
    """The check below is only as good as this: a planted three-module circle (one edge lazy) is found with the
    file:line of each edge; an import of an ancestor package and a ``TYPE_CHECKING`` import close no circle."""
    room = PACKAGE / "derivations" / "planted"
    a, b, c, init = (room / f"{n}.py" for n in ("a", "b", "c", "__init__"))
    mod = "ledgerspec.derivations.planted"
    modules = frozenset({mod, f"{mod}.a", f"{mod}.b", f"{mod}.c"})
    imports = [
        Import(f"{mod}.b.thing", a, 3, False, False),
        Import(f"{mod}.c", b, 5, True, False),  # lazy: counts
        Import(f"{mod}.a", c, 7, False, False),
        Import(f"{mod}.a", init, 1, False, False),  # the package imports a: the ancestor edges back are not circles
        Import(mod, a, 2, False, False),
        Import(f"{mod}.c", init, 2, False, False),
        Import(f"{mod}.b", c, 9, False, True),  # TYPE_CHECKING only: no edge
    ]
    found = circles(imports, modules)
    assert len(found) == 1, found
    assert found[0].splitlines() == [
        f"circle of 3 modules: {mod}.a, {mod}.b, {mod}.c",
        f"  ledgerspec/derivations/planted/a.py:3: {mod}.a -> {mod}.b",
        f"  ledgerspec/derivations/planted/b.py:5: {mod}.b -> {mod}.c (inside a function)",
        f"  ledgerspec/derivations/planted/c.py:7: {mod}.c -> {mod}.a",
    ]
    assert circles(imports[:2] + imports[3:], modules) == [], "breaking one edge breaks the circle"
    assert _loaded("ledgerspec.derivations.shard.sharder.shard", MODULE_NAMES) == "ledgerspec.derivations.shard.sharder"


def test_no_import_circles_inside_any_wing() -> None:
    """No import circles inside any wing (nor across wings, which the rule above already forbids): every module can be
    read after the modules it imports. Lazy imports inside functions count: they are how a circle hides."""
    found = circles(ALL_IMPORTS)
    assert not found, "import circles (move the shared pieces down into a module both import):\n" + "\n".join(found)


SHARD = "ledgerspec.derivations.shard"
#: the shard room's floors, lowest first (each name a module or a subpackage of ``shard``): the base every strategy
#: imports, CPU offload (both FSDP's and ZeRO's), the strategies, the entry point that dispatches to them, and the
#: package's ``__init__`` that exports it
SHARD_FLOORS = (
    ("state", "model", "options", "patching", "simulation", "plans"),
    ("offload",),
    ("fsdp", "zero"),
    ("sharder",),
    ("",),
)


def shard_sideways(imports: list[Import], modules: frozenset[str] = MODULE_NAMES) -> list[str]:
    """The imports inside ``shard`` that do not point down a floor of :data:`SHARD_FLOORS`: a strategy importing
    another (FSDP <-> ZeRO), offload or the base importing a strategy, anything importing the sharder. Within the
    base and within one part (``fsdp.simulate`` -> ``fsdp.workload``) imports are free (the circle test orders them)."""
    floor = {part: i for i, parts in enumerate(SHARD_FLOORS) for part in parts}

    def part(module: str) -> str:
        return module.removeprefix(SHARD).lstrip(".").split(".")[0]

    bad = []
    for src, targets in import_graph(imports, modules).items():
        if not src.startswith(SHARD):
            continue
        for dst, imps in targets.items():
            if not dst.startswith(SHARD) or part(dst) == part(src):
                continue
            a, b = floor[part(src)], floor[part(dst)]
            if b > a or (b == a and a > 0):
                why = f"{part(src) or 'shard'} must not import {part(dst) or 'shard'}"
                bad += [f"{i.file.relative_to(PACKAGE.parent)}:{i.line}: {src} -> {dst}  ({why})" for i in imps]
    return sorted(set(bad))


def test_the_shard_rooms_import_only_downwards() -> None:
    """Inside ``shard`` each strategy's room imports only the base (and offload), never another strategy, and only the
    sharder (on top) imports the strategies; a planted ZeRO -> FSDP import is caught."""
    room = PACKAGE / "derivations" / "shard"
    parts = {p.stem for p in room.glob("*.py") if p.stem != "__init__"} | {
        p.parent.name for p in room.glob("*/__init__.py")
    }
    assert parts <= {part for floor in SHARD_FLOORS for part in floor}, (
        "every module and subpackage of shard is on a floor"
    )
    zero = room / "zero" / "engine.py"
    planted = [
        Import(f"{SHARD}.fsdp.workload.x", zero, 1, True, False),
        Import(f"{SHARD}.options", zero, 2, False, False),
    ]
    assert shard_sideways(planted) == [
        f"ledgerspec/derivations/shard/zero/engine.py:1: {SHARD}.zero.engine -> {SHARD}.fsdp.workload  "
        "(zero must not import fsdp)"
    ]
    bad = shard_sideways(ALL_IMPORTS)
    assert not bad, "imports that do not point down the shard room's floors:\n" + "\n".join(bad)


def test_contract_imports_only_stdlib_jsonschema_and_ruamel() -> None:
    stdlib = set(sys.stdlib_module_names)
    bad = [
        _where(i)
        for i in ALL_IMPORTS
        if wing_of_file(i.file) in ("contract", "base")
        and not i.type_only
        and _top(i.module) not in stdlib
        and _top(i.module) not in CONTRACT_THIRD_PARTY
        and _top(i.module) != "ledgerspec"
    ]
    assert not bad, "contract imports only stdlib + jsonschema + ruamel.yaml:\n" + "\n".join(bad)


def test_heavy_libraries_only_in_derivations_and_inside_functions() -> None:
    outside = [
        _where(i)
        for i in ALL_IMPORTS
        if _top(i.module) in HEAVY and not i.type_only and wing_of_file(i.file) != "derivations"
    ]
    assert not outside, "torch & co. are imported only in ledgerspec/derivations/:\n" + "\n".join(outside)
    eager = [_where(i) for i in ALL_IMPORTS if _top(i.module) in HEAVY and not i.type_only and not i.nested]
    assert not eager, "torch & co. are imported lazily, inside functions:\n" + "\n".join(eager)


_STARTUP = """
import json, sys
import ledgerspec, ledgerspec.faces.cli as cli
cli.build_parser()
import ledgerspec.checks.validate, ledgerspec.faces.commands.validate
from tests.support import REPO_ROOT
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in HEAVY)))
"""


def test_cli_startup_imports_no_heavy_library() -> None:
    """What ``ledgerspec validate`` loads at start (every command module of ``faces/commands/``) pulls in none of torch
    & co."""
    code = f"HEAVY = {HEAVY!r}\n" + _STARTUP
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"startup imported heavy libraries: {loaded}"
    folder = PACKAGE / "faces" / "commands"
    commands = sorted([p.stem for p in folder.glob("*.py")] + [p.parent.name for p in folder.glob("*/__init__.py")])
    assert {"estimate", "measure", "resolve", "validate"} <= set(commands)


IO_MODULES = ("os", "sys", "io", "pathlib", "shutil", "subprocess", "tempfile", "socket", "urllib", "glob")
IO_CALLS = ("open", "print", "input")


def test_checks_are_pure_functions_of_a_document() -> None:
    """The checks wing reads a loaded document and returns findings: no files, no streams, no processes."""
    bad = [_where(i) for i in ALL_IMPORTS if wing_of_file(i.file) == "checks" and _top(i.module) in IO_MODULES]
    for file in (PACKAGE / "checks").glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in IO_CALLS:
                bad.append(f"{file.relative_to(PACKAGE.parent)}:{node.lineno}: {node.func.id}()")
    assert not bad, "checks does no I/O:\n" + "\n".join(bad)


#: names a document goes by outside the contract
DOCUMENT_NAMES = ("doc", "document", "intake", "ledger")


def test_only_the_contract_edits_a_document() -> None:
    """Outside ``contract/`` nothing reaches into a document's round-trip tree or plain copy: every edit goes
    through :mod:`ledgerspec.contract.edit` (``checks`` may read the plain copy, for the JSON Schema)."""
    bad = []
    for file in MODULES:
        wing = wing_of_file(file)
        if wing in ("contract", "base"):
            continue
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Attribute) or node.attr not in ("plain", "data", "edits", "status_edit"):
                continue
            owner = node.value
            name = owner.id if isinstance(owner, ast.Name) else owner.attr if isinstance(owner, ast.Attribute) else ""
            if name not in DOCUMENT_NAMES:
                continue
            if wing == "checks" and node.attr == "plain" and isinstance(node.ctx, ast.Load):
                continue
            bad.append(f"{file.relative_to(PACKAGE.parent)}:{node.lineno}: {name}.{node.attr}")
    # the planted case: the check sees ``doc.plain`` in a derivation
    probe = ast.parse("def f(doc):\n    doc.plain['x'] = 1\n")
    assert any(isinstance(n, ast.Attribute) and n.attr == "plain" for n in ast.walk(probe))
    assert not bad, "documents are edited only through ledgerspec.contract.edit:\n" + "\n".join(bad)


def test_every_room_exports_its_entry_point() -> None:
    """A newcomer finds any figure's code from its name: each room of derivations says what it holds and exports
    its entry point from ``__init__``."""
    import importlib

    entries = {
        "stack": "census",
        "engine": "run_protocol",
        "resolve": "resolve",
        "estimate": "estimate",
        "measure": "measure",
        "shard": "shard",
        "devices": "compare",
        "allocator": "replay",
        "kernels": "simulated_kernels",
    }
    rooms = sorted(p.name for p in (PACKAGE / "derivations").iterdir() if (p / "__init__.py").is_file())
    assert sorted(entries) == [r for r in rooms if r in entries] and set(rooms) <= set(entries) | {"integrations"}
    for room, entry in entries.items():
        module = importlib.import_module(f"ledgerspec.derivations.{room}")
        assert callable(getattr(module, entry)), room
        assert module.__doc__ and ":mod:" in module.__doc__, f"{room}/__init__.py lists its modules"
    flat = sorted(p.name for p in (PACKAGE / "derivations").glob("*.py") if p.name != "__init__.py")
    assert flat == [], f"derivations holds rooms, not loose modules: {flat}"

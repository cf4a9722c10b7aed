"""The four wings and their one-way arrows, read off every module's imports with ``ast``.

contract <- checks <- derivations <- faces: a wing imports only wings to its left. The heavy libraries
(torch & co.) are imported only inside ``ledgerspec/derivations/`` and only inside functions, so that the
light commands (``validate``, ``schema``, ``init``) start without them.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ledgerspec"
WINGS = ("contract", "checks", "derivations", "faces")
#: what each wing may NOT import
FORBIDDEN = {
    "contract": ("checks", "derivations", "faces"),
    "checks": ("derivations", "faces"),
    "derivations": ("faces",),
    "faces": (),
}
#: the top-level modules no wing may import except derivations, and there only inside functions
HEAVY = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "numpy", "pynvml", "nvidia_ml_py", "psutil")
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


def _wing(file: Path) -> str | None:
    rel = file.relative_to(PACKAGE).parts
    return rel[0] if len(rel) > 1 and rel[0] in WINGS else None


def _top(module: str) -> str:
    return module.split(".")[0]


MODULES = sorted(PACKAGE.rglob("*.py"))
ALL_IMPORTS = [imp for f in MODULES for imp in _imports(f)]


def _where(imp: Import) -> str:
    return f"{imp.file.relative_to(PACKAGE.parent)}:{imp.line}: {imp.module}"


def test_the_parser_sees_nested_relative_and_dynamic_imports(tmp_path: Path) -> None:
    """The checks below are only as good as this parser: nested, relative and dynamic imports are seen."""
    probe = PACKAGE / "derivations" / "resolve" / "resolver.py"
    found = _imports(probe)
    assert any(i.module.startswith("ledgerspec.contract") and not i.nested for i in found)
    assert any(_top(i.module) in HEAVY and i.nested for i in found), "resolve imports torch & co. lazily"
    cli = _imports(PACKAGE / "faces" / "commands" / "schema.py")
    assert any(i.module == "ledgerspec.contract.schema" and i.nested for i in cli)
    tree = ast.parse("from . import units\nfrom ..errors import X\n")
    nodes = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert "ledgerspec.contract.units" in _resolve(nodes[0], PACKAGE / "contract" / "writer.py")
    assert "ledgerspec.errors" in _resolve(nodes[1], PACKAGE / "contract" / "writer.py")


@pytest.mark.parametrize("wing", WINGS)
def test_arrows_point_inward(wing: str) -> None:
    bad = [
        _where(i)
        for i in ALL_IMPORTS
        if _wing(i.file) == wing
        and any(i.module == f"ledgerspec.{w}" or i.module.startswith(f"ledgerspec.{w}.") for w in FORBIDDEN[wing])
    ]
    assert not bad, f"{wing} must not import {', '.join(FORBIDDEN[wing])}:\n" + "\n".join(bad)


def test_contract_imports_only_stdlib_jsonschema_and_ruamel() -> None:
    stdlib = set(sys.stdlib_module_names)
    bad = [
        _where(i)
        for i in ALL_IMPORTS
        if _wing(i.file) == "contract"
        and not i.type_only
        and _top(i.module) not in stdlib
        and _top(i.module) not in CONTRACT_THIRD_PARTY
        and _top(i.module) != "ledgerspec"
    ]
    assert not bad, "contract imports only stdlib + jsonschema + ruamel.yaml:\n" + "\n".join(bad)


def test_heavy_libraries_only_in_derivations() -> None:
    bad = [
        _where(i) for i in ALL_IMPORTS if _top(i.module) in HEAVY and not i.type_only and _wing(i.file) != "derivations"
    ]
    assert not bad, "torch & co. are imported only in ledgerspec/derivations/:\n" + "\n".join(bad)


def test_heavy_libraries_only_inside_functions() -> None:
    bad = [_where(i) for i in ALL_IMPORTS if _top(i.module) in HEAVY and not i.type_only and not i.nested]
    assert not bad, "torch & co. are imported lazily, inside functions:\n" + "\n".join(bad)


_STARTUP = """
import json, sys
import ledgerspec, ledgerspec.faces.cli as cli
cli.build_parser()
import ledgerspec.checks.validate, ledgerspec.faces.commands.validate
print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in HEAVY)))
"""


def test_cli_startup_imports_no_heavy_library() -> None:
    """What ``ledgerspec validate`` loads at start (every ``faces/commands/*.py``) pulls in none of torch & co."""
    code = f"HEAVY = {HEAVY!r}\n" + _STARTUP
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded == [], f"startup imported heavy libraries: {loaded}"
    commands = sorted(p.stem for p in (PACKAGE / "faces" / "commands").glob("*.py"))
    assert {"estimate", "measure", "resolve", "validate"} <= set(commands)


IO_MODULES = ("os", "sys", "io", "pathlib", "shutil", "subprocess", "tempfile", "socket", "urllib", "glob")
IO_CALLS = ("open", "print", "input")


def test_checks_are_pure_functions_of_a_document() -> None:
    """The checks wing reads a loaded document and returns findings: no files, no streams, no processes."""
    bad = [_where(i) for i in ALL_IMPORTS if _wing(i.file) == "checks" and _top(i.module) in IO_MODULES]
    for file in (PACKAGE / "checks").glob("*.py"):
        for node in ast.walk(ast.parse(file.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in IO_CALLS:
                bad.append(f"{file.relative_to(PACKAGE.parent)}:{node.lineno}: {node.func.id}()")
    assert not bad, "checks does no I/O:\n" + "\n".join(bad)

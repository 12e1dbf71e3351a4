"""The package's layout rules, read from the source: its modules import one another without a cycle, and only the
command line parses arguments."""

import ast
from pathlib import Path

import encoderstack

PACKAGE = Path(encoderstack.__file__).parent
COMMAND_LINE = ("encoderstack.cli", "encoderstack.commands")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The absolute name of everything `name` imports anywhere in its file, inside functions too (a lazy import hides
    a cycle, it does not remove it); `from package import name` gives the module `package.name` where there is one."""
    package = name if MODULES[name].name == "__init__.py" else name.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package.split(".")[: package.count(".") + 2 - node.level], *filter(None, [base])])
            names |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names}
    return names


def imported_modules(name: str) -> set[str]:
    """The package modules `name` imports, with the packages above them that importing them runs first (except the
    ones `name` itself lies in: those are already running)."""
    targets = {target for target in imports(name) if target in MODULES}
    own = {".".join(name.split(".")[:end]) for end in range(1, name.count(".") + 2)}
    above = {".".join(target.split(".")[:end]) for target in targets for end in range(1, target.count(".") + 1)}
    return (targets | above - own) - {name}


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of `graph` as the modules along it, or None."""
    done, path = set(), []

    def visit(name):
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        path.append(name)
        found = next((found for target in sorted(graph[name]) if (found := visit(target))), None)
        path.pop()
        done.add(name)
        return found

    return next((found for name in sorted(graph) if (found := visit(name))), None)


def test_the_package_has_no_import_cycle():
    found = cycle({name: imported_modules(name) for name in MODULES})
    assert found is None, "import cycle: " + " -> ".join(found)


def test_the_cycle_check_finds_a_cycle_and_sees_imports_inside_functions():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None
    converter = imported_modules("encoderstack.conversion.converter")
    assert {"encoderstack.conversion.verify", "encoderstack.hub_card"} <= converter  # inside check_parity; a package


def test_no_module_outside_the_command_line_imports_argparse():
    parsing = [name for name in MODULES if not name.startswith(COMMAND_LINE) and "argparse" in imports(name)]
    assert parsing == []

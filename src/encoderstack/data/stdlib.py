"""A real English corpus nobody on this project wrote, built offline from the installed Python: the prose of its
standard-library docstrings (PSF licence). `diagnose --corpus stdlib` trains on it; `pretrain` keeps its old name."""

import ast
import sys
import sysconfig
import warnings
from pathlib import Path

SKIPPED_PARTS = {"test", "tests", "idle_test", "idlelib", "turtledemo", "lib2to3", "pydoc_data", "site-packages"}


def stdlib_sources():
    """The installed Python's standard-library source files, in a fixed order (modules sorted by name)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in SKIPPED_PARTS or name in ("this", "antigravity"):
            continue
        if (root / f"{name}.py").is_file():
            yield root / f"{name}.py"
        elif (root / name / "__init__.py").is_file():
            yield from sorted(
                p for p in (root / name).rglob("*.py") if not SKIPPED_PARTS & set(p.relative_to(root).parts)
            )


def docstrings(path: Path):
    with warnings.catch_warnings():  # old escape sequences in a few stdlib files
        warnings.simplefilter("ignore")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError):
            return
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=True)  # what inspect.getdoc gives for the live object
            if text:
                yield text


def prose(docstring: str) -> str:
    """A docstring's paragraphs of running text, one a line: no code, no doctests, no tables or argument lists."""
    paragraphs = []
    for block in docstring.split("\n\n"):
        lines = block.splitlines()
        if any(line.startswith((" ", ">>>", "...", "-", "*", "|", "=")) for line in lines):
            continue
        text = " ".join(line.strip() for line in lines)
        if len(text.split()) >= 6 and sum(c.isalpha() for c in text) > 0.7 * len(text.replace(" ", "")):
            paragraphs.append(text)
    return "\n".join(paragraphs)


def stdlib_corpus(path, max_bytes: int = 500_000) -> Path:
    """Write a real English corpus nobody on this project wrote: the prose of the installed Python's standard-library
    docstrings (PSF licence), one docstring a document, one paragraph a line, whole documents up to `max_bytes`.
    The same Python gives the same bytes every time."""
    path, written, seen = Path(path), 0, set()
    with path.open("w", encoding="utf-8") as out:
        for source in stdlib_sources():
            for text in map(prose, docstrings(source)):
                size = len(text.encode()) + 2
                if not text or text in seen:
                    continue
                if written + size > max_bytes:
                    return path
                seen.add(text)
                out.write(text + "\n\n")
                written += size
    return path

"""The house rules (issue 64), read off the source: rooms with one job, no import circle, HTTP in
phi2_server.py alone. They fail when the tree grows out of its shape, not when behaviour changes.

- backends/'s rooms by concern (CONCERNS) import no runtime: not torch, mlx, triton or aiohttp, nor
  backends/torch or backends/mlx; anything that needs a runtime lives in that runtime's room.
- Only phi2_server.py imports aiohttp's web framework, and it stays under APP_LINES.
- No import circle among backends/'s modules, imports inside functions included (they run too,
  later): a circle means two rooms that cannot be read apart.
- A Python file in backends/ stays under FILE_LINES, a section under SECTION_LINES; kernels (C++,
  Triton) aside. A section runs from a `# -- ` heading (at any depth: a class's parts have theirs)
  or a top-level definition to the next one; phi2_server.py's sections are its headings' alone.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BACKENDS = ROOT / "backends"
CONCERNS = ("chat", "decoding", "workers", "files", "encoders", "wire")
RUNTIME_PACKAGES = {"torch", "mlx", "mlx_lm", "triton", "aiohttp"}
RUNTIME_ROOMS = ("backends.torch", "backends.mlx")
APP_LINES = 3000  # phi2_server.py: HTTP only (each API's schema and shapes are in backends/wire)
FILE_LINES = 900
SECTION_LINES = 250
KERNELS = ("backends/torch/cuda/triton_",)  # Triton kernels: a kernel file may pass FILE_LINES


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(BACKENDS.rglob("*.py"))}


def imports(path: Path, name: str | None = None) -> set[str]:
    """Every module `path` imports, at its top or inside a function, by its full dotted name
    (`from a.b import c` is a.b.c where that is a module, else a.b)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return found


def own(target: str) -> str | None:
    """The backends module an import lands in, or None for another package."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


GRAPH = {name: {own(t) for t in imports(path)} - {None, name} for name, path in MODULES.items()}


def test_the_rooms_exist_and_the_concern_rooms_import_no_runtime():
    assert {name.split(".")[1] for name in MODULES if name.count(".") >= 2} >= {*CONCERNS, "torch", "mlx"}
    wrong = {}
    for name, path in MODULES.items():
        if name.split(".")[1:2] and name.split(".")[1] in CONCERNS:
            bad = {t for t in imports(path) if t.split(".")[0] in RUNTIME_PACKAGES or t.startswith(RUNTIME_ROOMS)}
            if bad:
                wrong[name] = sorted(bad)
    assert wrong == {}, "a concern room imports a runtime; move that code to backends/torch or backends/mlx"


def test_only_the_application_module_imports_aiohttp_web():
    users = {name for name, path in MODULES.items() if any(t.startswith("aiohttp") for t in imports(path))}
    assert users == set()


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle():
    assert circles(GRAPH) == []


TOP_LEVEL = ("def ", "async def ", "class ", "@")


def sections(lines: list[str], definitions: bool = True) -> list[tuple[str, int]]:
    """(heading, length) of each section, the lines before the first included: a section starts
    at a `# -- ` heading, and with `definitions` at a top-level definition (its decorators first)."""
    found, heading, start = [], "(the file's start)", 0
    for number, line in enumerate(lines):
        starts = definitions and line.startswith(TOP_LEVEL) and not lines[number - 1].startswith("@")
        if line.lstrip().startswith("# -- ") or starts:
            found.append((heading, number - start))
            heading, start = line.strip(), number
    found.append((heading, len(lines) - start))
    return found


@pytest.mark.parametrize("path", [p for p in MODULES.values()], ids=lambda p: str(p.relative_to(ROOT)))
def test_a_backends_file_and_its_sections_stay_small(path):
    relative = str(path.relative_to(ROOT))
    lines = path.read_text().splitlines()
    if not relative.startswith(KERNELS):
        assert len(lines) <= FILE_LINES, f"{relative}: {len(lines)} lines; split it by job"
    long = [(heading, n) for heading, n in sections(lines) if n > SECTION_LINES]
    assert long == [], f"{relative}: sections over {SECTION_LINES} lines"


def test_the_application_module_stays_http_sized():
    lines = len((ROOT / "phi2_server.py").read_text().splitlines())
    assert lines <= APP_LINES, f"phi2_server.py has {lines} lines: move what is not HTTP to backends/"


def test_the_application_module_sections_stay_small():
    lines = (ROOT / "phi2_server.py").read_text().splitlines()
    long = [(h, n) for h, n in sections(lines, definitions=False) if n > SECTION_LINES]
    assert long == []


def test_the_house_test_sees_a_circle_and_a_lazy_runtime_import(tmp_path):
    """The checks above can fail: a lazy import back into a module's importer is a circle, and
    an import inside a function is an import."""
    graph = {k: set(v) for k, v in GRAPH.items()}
    graph["backends.chat.tools"].add("backends.chat.plan")  # plan imports tools at its top
    assert circles(graph) == [["backends.chat.plan", "backends.chat.tools"]]
    lazy = tmp_path / "lazy.py"
    lazy.write_text("def f():\n    import torch.nn\n    from backends.torch import runtime\n")
    assert imports(lazy, "backends.chat.lazy") == {"torch.nn", "backends.torch", "backends.torch.runtime"}
    assert sections(["a", "# -- one", "b", "c", "  # -- two", "d"]) == [
        ("(the file's start)", 1),
        ("# -- one", 3),
        ("# -- two", 2),
    ]

"""The parts import one way (the design's table): kernels and quantizers know nothing of models, the model
knows nothing of calibration or quantizers, and nothing imports the CLI. Read from the source with `ast`,
function-local imports included, so a new edge against the grain fails here rather than in review."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"qinfer": "qinfer", "kernels": "qinfer.kernels", "quantizers": "qinfer.quantizers",
           "calib": "qinfer.calib", "evals": "qinfer.evals"}

PARTS = {  # part -> module prefixes (a prefix matches the module and its submodules): its folder, mostly
    "errors": ["qinfer.errors", "qinfer.deps"],  # the error type and the tested versions: the standard library only
    "store": ["qinfer.store"],
    "sources": ["qinfer.sources"],
    "kernels": ["qinfer.kernels"],
    "quantizers": ["qinfer.quantizers"],
    "calib": ["qinfer.calib"],
    "evals": ["qinfer.evals"],
    "model": ["qinfer.model"],
    "converters": ["qinfer.format", "qinfer.interop.gptq", "qinfer.interop.compressed_tensors", "qinfer.interop.common"],
    "pipeline": ["qinfer.pipeline"],
    "engine": ["qinfer.engine"],
    "server": ["qinfer.server"],
    # the click classes with one-line errors that qinfer and the python -m qinfer.evals.* tools are built on
    "console": ["qinfer.cli.command"],
    "cli": ["qinfer.cli"],
}
ABOVE_GROUND = ["sources", "kernels", "model", "calib", "quantizers", "pipeline", "engine", "server", "evals", "cli"]
NEVER = {  # part -> parts it must never import (only entry points may import "console", the click classes)
    "errors": ["store", "converters"] + ABOVE_GROUND + ["console"],
    "store": ABOVE_GROUND + ["console"],
    # (sources reach the model through qinfer.interop.folders, which converts an imported checkpoint)
    "sources": ["kernels", "calib", "quantizers", "pipeline", "engine", "server", "evals", "console", "cli"],
    "kernels": ["model", "calib", "quantizers", "pipeline", "engine", "server", "evals", "console", "cli"],
    "quantizers": ["model", "kernels", "calib", "pipeline", "engine", "server", "evals", "console", "cli"],
    "converters": ["model", "calib", "quantizers", "pipeline", "engine", "server", "evals", "console", "cli"],
    "model": ["calib", "quantizers", "pipeline", "engine", "server", "evals", "console", "cli"],
    "calib": ["quantizers", "pipeline", "engine", "server", "evals", "console", "cli"],
    "engine": ["calib", "quantizers", "pipeline", "server", "evals", "console", "cli"],
    "pipeline": ["engine", "server", "evals", "console", "cli"],
    "server": ["calib", "quantizers", "pipeline", "evals", "console", "cli"],
    "evals": ["server", "cli"],
    "console": ABOVE_GROUND,
}


def module_name(path: Path) -> str:
    folder = path.relative_to(ROOT).parts[0]
    rest = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
    return ".".join([FOLDERS[folder], *rest])


def imports(path: Path) -> set[str]:
    """Every qinfer module `path` imports; `from a import b` counts as both `a` and `a.b`."""
    module = module_name(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "qinfer" or name.startswith("qinfer.")}


def part_of(module: str) -> str | None:
    for part, prefixes in PARTS.items():
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return part
    return None


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def test_the_scan_sees_known_edges():
    # The checker itself: it finds relative, absolute and function-local imports.
    edges = {module_name(p): imports(p) for p in sources()}
    assert "qinfer.cli.commands" in edges["qinfer.__main__"]
    assert "qinfer.format" in edges["qinfer.quantizers.rtn"]
    assert "qinfer.kernels.dense" in edges["qinfer.calib.capture"]
    assert part_of("qinfer.interop.gptq") == "converters" and part_of("qinfer.kernels.gemv_cpu") == "kernels"


@pytest.mark.parametrize("path", sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_follow_the_design(path):
    module = module_name(path)
    part = part_of(module)
    bad = sorted(t for t in imports(path) if part_of(t) in NEVER.get(part, []))
    if module != "qinfer.__main__":
        bad += sorted(t for t in imports(path) if part_of(t) == "cli" and part != "cli")
    assert not bad, f"{module} ({part}) imports {sorted(set(bad))} against the design's direction"


def test_no_module_imports_itself_around_a_circle():
    # A circle (a imports b imports a), even through a function-local import, means neither can be read or
    # changed alone: each strongly connected group of the import graph must be one module.
    edges = {module_name(p): imports(p) for p in sources()}
    graph = {m: sorted(t for t in targets if t in edges and t != m) for m, targets in edges.items()}
    circles = [group for group in strongly_connected(graph) if len(group) > 1]
    assert not circles, f"import circles: {circles}"


def strongly_connected(graph: dict[str, list[str]]) -> list[list[str]]:
    """Tarjan's algorithm, iterative: the graph's strongly connected groups of nodes."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []
    for root in graph:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = len(index)
                stack.append(node)
                on_stack.add(node)
            for j in range(i, len(graph[node])):
                nxt = graph[node][j]
                if nxt not in index:
                    work += [(node, j + 1), (nxt, 0)]
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                if low[node] == index[node]:
                    group = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        group.append(top)
                        if top == node:
                            break
                    groups.append(sorted(group))
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
    return groups


def test_the_circle_check_finds_a_circle():
    assert strongly_connected({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"], ["d"]]


def test_the_library_runs_without_click():
    # Only the command-line entry points need click: the quantizers, kernels, model and pipeline raise QinferError
    # without importing it.
    import subprocess
    import sys

    code = ("import sys; import qinfer.pipeline.quantize, qinfer.engine.generate, qinfer.interop.folders; "
            "print('click' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"

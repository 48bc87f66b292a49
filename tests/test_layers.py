"""The architecture as a test: imports only go down the layers of DESIGN.md, no two files import each other (directly
or round a longer circle), and the engine and the rollout loop import no command-line dependencies."""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
# the import name of each top-level folder (`kernels/` installs as `rollout_kernels`: Hugging Face's `kernels`
# package owns the name `kernels`)
FOLDERS = {"kernels": "rollout_kernels", "specdec": "specdec", "rollout": "rollout"}
PACKAGES = tuple(FOLDERS.values())
# lowest first: a module may import its own layer and the layers below it, never one above
LAYERS = [
    ("kernels", ("rollout_kernels",)),
    ("specdec", ("specdec",)),
    ("models", ("rollout.models",)),
    ("engine", ("rollout.engine",)),
    ("rollout loop", ("rollout",)),
    ("command line", ("rollout.cli", "rollout.__main__")),
]


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    parts[0] = FOLDERS[parts[0]]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    """The index in LAYERS of the most specific prefix that holds `module`."""
    best, length = None, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > length:
                best, length = index, len(prefix)
    assert best is not None, f"expected {module} in a layer of {[name for name, _ in LAYERS]}"
    return best


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            found[module_name(path)] = path
    return found


def imports(path: pathlib.Path, known: dict[str, pathlib.Path]) -> set[str]:
    """The project modules a file imports anywhere in it (function-level imports too): `from a.b import c` counts as
    `a.b.c` when that is a module, else `a.b`."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
            names = [n for n in names if n in known] or [node.module]
        else:
            continue
        found |= {n for n in names if n.split(".")[0] in PACKAGES and n in known}
    return found


def test_imports_only_go_down_the_layers():
    known = modules()
    upward = []
    for module, path in known.items():
        for target in imports(path, known):
            if layer_of(target) > layer_of(module) and not _is_facade(module, target):
                upward.append(
                    f"{module} ({LAYERS[layer_of(module)][0]}) imports {target} ({LAYERS[layer_of(target)][0]})"
                )
    assert not upward, "imports against the layering:\n" + "\n".join(upward)


def _is_facade(module: str, target: str) -> bool:
    """A package's __init__ re-exporting its own submodules is not a dependency of the layer on them."""
    return module in PACKAGES and target.startswith(module + ".")


def test_no_two_files_import_each_other():
    known = modules()
    graph = {m: {t for t in imports(p, known) if t != m and not _is_facade(m, t)} for m, p in known.items()}
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(graph[module]):
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target) :] + [target]))
            elif target not in state:
                visit(target, [*path, target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles, "import circles:\n" + "\n".join(circles)


def test_the_engine_and_the_loop_import_no_command_line_dependencies():
    code = (
        "import sys; import rollout.engine.generator, rollout.loop, rollout.batch, specdec, rollout_kernels; "
        "print(' '.join(m for m in ('wandb', 'matplotlib', 'omegaconf', 'datasets', 'trl') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.strip() == "", f"imported by the engine or the loop: {result.stdout.strip()}"


def test_the_layer_map_knows_every_module():
    assert {layer_of(m) for m in modules()} == set(range(len(LAYERS)))

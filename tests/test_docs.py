"""The documentation as a test: the user guide builds with `mkdocs build --strict` (a broken link, anchor or API
reference fails), the README's Python example runs as written, configuration fields are documented where `help()` and
the API reference show them, and no dated measurement sits in the README, the recipes or a docstring (numbers live on
the benchmarks pages, with their setup)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import os
import pathlib
import re
import subprocess
import sys

import pytest

import rollout

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
PACKAGES = ("rollout", "specdec", "kernels")  # folders whose docstrings are the library's promises
DATED = re.compile(r"\b20\d\d-\d\d\b|this CPU", re.IGNORECASE)
SETUP_COMMANDS = (  # CI's .ci/run executes exactly these (with pip's -q)
    "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 '.[dev,trl]' && "
    ".venv/bin/rollout run recipes/quickstart.yaml",
    ".venv/bin/python -m pytest -q -n 2",
)


def test_the_guide_builds_strictly(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    warnings = "\n".join(line for line in result.stderr.splitlines() if not line.startswith("INFO"))
    assert result.returncode == 0, f"mkdocs build --strict failed (the dev extra installs mkdocs):\n{warnings}"
    assert (tmp_path / "site" / "reference" / "api" / "index.html").is_file()


def docstrings(path: pathlib.Path):
    """(line, docstring) of the module, and of every class and function in it."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            text = ast.get_docstring(node, clean=False)
            if text:
                yield (node.body[0].lineno, text)


def test_no_dated_measurement_in_the_readme_recipes_or_docstrings():
    found = []
    sources = [ROOT / "README.md", *sorted((ROOT / "recipes").glob("*.yaml"))]
    for path in sources:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if DATED.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    modules = [path for folder in PACKAGES for path in sorted((ROOT / folder).rglob("*.py"))]
    assert len(modules) > 50, "expected the packages' modules"
    for path in modules:
        for number, text in docstrings(path):
            for match in DATED.finditer(text):
                found.append(f"{path.relative_to(ROOT)}:{number}: docstring holds {match.group()!r}")
    assert not found, "dated measurements (move them to docs/benchmarks/ with their setup):\n" + "\n".join(found)


def test_the_date_check_finds_a_date_and_this_cpu():
    assert DATED.search("measured 2026-11-24: 1.16x") and DATED.search("1.2x on this CPU")
    assert not DATED.search("torch 2.13.0, K = 4, 2-core CPU")


def python_block(text: str, heading: str) -> str:
    """The first ```python block after `heading`."""
    after = text[text.index(heading) :]
    match = re.search(r"```python\n(.*?)```", after, re.DOTALL)
    assert match, f"no python block after {heading!r}"
    return match.group(1)


def test_the_readme_python_example_runs_as_written(tmp_path):
    code = python_block(README, "## From Python")
    assert code in (ROOT / "docs" / "quickstart.md").read_text(), "the quickstart page must show the same example"
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1"], result.stdout
    assert all("64 samples" in line for line in lines)


def test_the_readme_keeps_the_commands_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text().replace("pip install -q ", "pip install ")
    for command in SETUP_COMMANDS:
        assert f"```bash\n{command}\n```" in README, f"the README must show {command!r} as its own block"
        assert command in ci, f".ci/run must run the README's {command!r}"


def field_docs(cls) -> list[str]:
    """The names an `Attributes:` section of `cls`'s docstring documents."""
    doc = inspect.getdoc(cls) or ""
    assert "Attributes:" in doc, f"{cls.__name__} documents its fields in no Attributes section"
    section = doc.split("Attributes:", 1)[1]
    return re.findall(r"^    (\w+):", section, re.MULTILINE)


def config_classes() -> list[type]:
    from rollout.cli import recipe

    recipes = [v for v in vars(recipe).values() if dataclasses.is_dataclass(v) and v.__module__ == recipe.__name__]
    assert len(recipes) >= 9, "expected the recipe sections"
    return [rollout.SpecConfig, rollout.SpecDecodeParams, rollout.SamplingParams, rollout.Completion, *recipes]


@pytest.mark.parametrize("cls", config_classes(), ids=lambda c: c.__name__)
def test_every_config_field_is_documented_in_its_docstring(cls):
    assert field_docs(cls) == [f.name for f in dataclasses.fields(cls)]


def test_the_api_reference_shows_every_public_name():
    page = (ROOT / "docs" / "reference" / "api.md").read_text()
    for name in rollout.__all__:
        module = getattr(rollout, name).__module__
        assert f"::: {module}.{name}" in page, f"docs/reference/api.md does not render {module}.{name}"


def documented_commands() -> list[tuple[str, list[str]]]:
    """(where, arguments) of every `rollout run|train|bench RECIPE ...` line in a bash block of the README and the
    guide (comments dropped)."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for block in re.findall(r"```bash\n(.*?)```", path.read_text(), re.DOTALL):
            for line in block.splitlines():
                words = line.split("#", 1)[0].split()
                for i, word in enumerate(words[:-2]):
                    if (
                        word.endswith("rollout")
                        and words[i + 1] in ("run", "train", "bench")
                        and words[i + 2] != "RECIPE"
                    ):
                        found.append((f"{path.relative_to(ROOT)}: {line.strip()}", words[i + 1 :]))
    return found


def test_every_documented_command_states_a_valid_recipe():
    """A command a page gives loads its recipe with its overrides (a wrong override fails here, not in a user's
    hands)."""
    from rollout.cli.recipe import load_recipe

    commands = documented_commands()
    assert len(commands) >= 10, commands
    for where, (_, recipe, *overrides) in commands:
        try:
            load_recipe(ROOT / recipe, overrides)
        except ValueError as err:
            pytest.fail(f"{where}: {err}")

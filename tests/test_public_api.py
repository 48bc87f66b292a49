"""The public API: every public name is importable from `rollout`, `__all__` lists exactly those names, and importing
the package loads nothing heavy until a name is asked for (the command line checks a recipe before torch loads)."""

from __future__ import annotations

import importlib
import pathlib
import subprocess
import sys

import pytest

import rollout

ROOT = pathlib.Path(__file__).resolve().parent.parent

# each public name and the module that defines it
PUBLIC = {
    "Completion": "rollout.engine.sampling",
    "Generator": "rollout.engine.generator",
    "Progress": "rollout.cli.progress",
    "Rollout": "rollout.loop",
    "RolloutBatch": "rollout.batch",
    "RunTracker": "rollout.cli.tracking",
    "SamplingParams": "rollout.engine.sampling",
    "SpecConfig": "specdec.config",
    "SpecDecodeParams": "specdec.config",
    "trl_rollout_func": "rollout.integrations.trl",
}


def test_all_lists_exactly_the_public_names():
    assert sorted(rollout.__all__) == sorted(PUBLIC)
    assert "Ranks" not in rollout.__all__  # internal: data-parallel plumbing


@pytest.mark.parametrize("name", sorted(PUBLIC))
def test_every_public_name_imports_from_rollout_as_the_object_its_module_defines(name):
    value = getattr(rollout, name)
    assert value is getattr(importlib.import_module(PUBLIC[name]), name)
    assert (value.__doc__ or "").strip(), f"{name} has no docstring: the API reference would be empty"


def test_star_import_gives_exactly_all():
    namespace: dict = {}
    exec("from rollout import *", namespace)
    assert sorted(set(namespace) - {"__builtins__"}) == sorted(rollout.__all__)


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="module 'rollout' has no attribute 'Ranks'"):
        rollout.Ranks  # noqa: B018
    with pytest.raises(ImportError):
        exec("from rollout import Ranks", {})


def test_importing_the_package_or_the_spec_config_loads_no_torch():
    code = (
        "import sys; import rollout; a = 'torch' in sys.modules; "
        "from rollout import SpecConfig; SpecConfig(method='suffix'); b = 'torch' in sys.modules; print(a, b)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert result.stdout.split() == ["False", "False"], result.stderr

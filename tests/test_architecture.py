"""The package's architecture holds (issue #31): a folder per layer, imports that only point down (``lint-imports``
with the contracts of ``pyproject.toml``), no circle, no module over 450 lines but the strategy's one class (issue
#46), the private names the launcher builds on still there, and the README's layout table lists every folder."""

from __future__ import annotations

import importlib
import inspect
import os
import re
import shutil
import subprocess
import sys

import pytest

import lightning_mp_lstm
from tests.helpers import ROOT, run_command

PACKAGE = ROOT / "lightning_mp_lstm"
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
        "sys.exit(lint_imports_command())", "--no-cache"]
#: The layers of the ``layers`` contract, top first (folders on one layer are independent).
LAYERS = [["app"], ["strategy"], ["checkpoint"], ["pipeline"], ["planning"], ["models", "timeline", "data"], ["base"]]


def _folders() -> list[str]:
    return sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_lint_imports_keeps_every_contract():
    result = run_command(LINT, timeout=110)
    assert result.returncode == 0, result.stdout[-4000:]
    assert "Contracts: 3 kept, 0 broken." in result.stdout


@pytest.mark.timeout(120)
@pytest.mark.processes
def test_an_upward_import_or_a_circle_breaks_the_contracts(tmp_path):
    """The contracts catch what they are for: on a copy of the package, planning importing the pipeline (a layer
    above it) and the declaration importing its binding back (a circle) are each named."""
    copy = tmp_path / "lightning_mp_lstm"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    plan = copy / "planning" / "plan.py"
    plan.write_text(plan.read_text() + "\nfrom lightning_mp_lstm.pipeline import tied  # noqa: E402,F401\n")
    declaration = copy / "models" / "declaration.py"
    declaration.write_text(declaration.read_text() + "\nfrom lightning_mp_lstm.models import binding  # noqa\n")
    result = subprocess.run(LINT, cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)}, capture_output=True,
                            text=True, timeout=110)
    assert result.returncode == 1, result.stdout[-4000:]
    out = result.stdout
    assert "Imports only point down the layers BROKEN" in out
    assert "lightning_mp_lstm.planning is not allowed to import lightning_mp_lstm.pipeline" in out
    assert "- lightning_mp_lstm.planning.plan -> lightning_mp_lstm.pipeline.tied" in out
    assert "No cycles are allowed in lightning_mp_lstm.models." in out
    assert "Contracts: 1 kept, 2 broken." in out  # the forbidden contract still holds: no Lightning came in


def test_every_folder_stands_on_one_layer_and_holds_only_modules():
    assert sorted(f for layer in LAYERS for f in layer) == _folders()
    assert [p.name for p in PACKAGE.glob("*.py")] == ["__init__.py"]  # nothing beside the folders
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert "\n".join(f'    "{" | ".join(layer)}",' for layer in LAYERS) in pyproject


#: The one module allowed past 450 lines: ``MPLSTMStrategy``, the one class that holds every hook Lightning calls (each
#: a call into its collaborators), rather than mixins in other files that a reader would have to assemble.
STRATEGY_MODULE, STRATEGY_LINES = "lightning_mp_lstm/strategy/strategy.py", 560


def test_no_module_is_longer_than_450_lines_but_the_strategy_s_one_class():
    lengths = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in lengths.items() if n > 450 and name != STRATEGY_MODULE} == {}
    assert lengths[STRATEGY_MODULE] <= STRATEGY_LINES
    assert len(lengths) > 80  # every module was read


def test_the_private_lightning_hydra_and_torch_names_the_package_builds_on_are_still_there():
    """The launcher's shim (``launcher.PRIVATE_API``) and the pipeline stage's (``stages.PRIVATE_API``): a Lightning,
    Hydra or torch that renames one of them fails here."""
    from lightning_mp_lstm.pipeline import stages
    from lightning_mp_lstm.strategy.launcher import PRIVATE_API

    missing = []
    for module_name, names in [*PRIVATE_API.items(), *stages.PRIVATE_API.items()]:
        module = importlib.import_module(module_name)
        for name, attributes in names.items():
            thing = getattr(module, name, None)
            if thing is None:
                missing.append(f"{module_name}.{name}")
                continue
            source = inspect.getsource(thing) if attributes else ""
            missing += [f"{module_name}.{name}.{a}" for a in attributes
                        if not hasattr(thing, a) and f"self.{a} =" not in source]
    assert missing == []
    assert len(PRIVATE_API) == 3 and len(stages.PRIVATE_API) == 2


def test_the_strategy_is_one_class_of_the_project_s_own():
    own = [c.__name__ for c in lightning_mp_lstm.MPLSTMStrategy.__mro__ if c.__module__.startswith("lightning_mp_lstm")]
    assert own == ["MPLSTMStrategy"]


def test_the_readme_lists_every_folder_on_a_line_of_its_own():
    rows = re.findall(r"^\| `lightning_mp_lstm/(\w+)/` \|", (ROOT / "README.md").read_text(), flags=re.MULTILINE)
    assert rows == [folder for layer in LAYERS for folder in layer]


def test_the_public_names_are_importable_from_the_package():
    names = ["CheckpointError", "DivergenceError", "DivergenceGuard", "LMDataModule", "LSTMBlocks", "LSTMLanguageModel",
             "LayoutError", "MPLSTMStrategy", "ModelDeclarationError", "ParallelLayout", "PartitionError",
             "PipelineModel", "PipelineTimeline", "RunStopped", "StopOnSignal"]
    assert sorted(lightning_mp_lstm.__all__) == names
    assert [getattr(lightning_mp_lstm, name).__name__ for name in names] == names
    assert lightning_mp_lstm.LMDataModule.__module__ == "lightning_mp_lstm.data.datamodule"

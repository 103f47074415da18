"""Every command the README and the docs quote still works: a renamed config group, option or script flag can never
again break a documented command unnoticed.

Every ``python train.py ...`` / ``torchrun ... train.py ...`` line of a shell block is composed with Hydra (each job
of a ``-m`` sweep on its own) and resolved as ``train()`` resolves it before launching anything: strategy, meta-built
model, processes, Trainer and the strategy's pre-launch checks. ``python generate.py ...`` lines compose
``conf/generate.yaml``; ``python benchmarks/<script>.py ...`` lines must name a script whose ``--help`` lists every
flag they use. The design card's commands (``python train.py partition=balanced4`` and ``balanced2``) also run, with
a few steps.
"""

from __future__ import annotations

import itertools
import re
import runpy
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

from lightning_mp_lstm.app import build_model, build_strategy, build_trainer
from tests.helpers import ROOT, SMALL_SYNTHETIC, TINY_RUN, run_command

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
VOCAB = 50
#: Words that make a quoted line a syntax template rather than a command.
TEMPLATE_WORDS = ("...", "group=option", "key=value")
#: Hydra's own flags (and how many values follow them), which are not overrides.
HYDRA_FLAGS = {"--help": 0, "--hydra-help": 0, "--cfg": 1, "--info": 0, "--resolve": 0}
#: Stand-ins for the placeholders pages use in commands.
PLACEHOLDERS = {"$PTB": "/data/ptb", "<date>": "2026-01-01", "<time>": "00-00-00"}


@dataclass(frozen=True)
class Command:
    """One documented command: where it is quoted, the script it runs and its arguments."""

    where: str
    script: str
    args: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.where}: {self.script} {' '.join(self.args)}"


def _shell_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of every fenced bash/shell/console block of a Markdown page."""
    blocks, current, start = [], None, 0
    for number, line in enumerate(text.splitlines(), start=1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and current is None:
            current, start = ([] if fence.group(1) in ("bash", "sh", "shell", "console") else None), number + 1
            if current is None:
                current = "skip"  # type: ignore[assignment]
        elif line.strip().startswith("```") and current is not None:
            if current != "skip":
                blocks.append((start, current))
            current = None
        elif current is not None and current != "skip":
            current.append(line)
    return blocks


def _command(text: str, where: str) -> Command | None:
    """The command ``text`` (one shell line) runs, if it starts one of this repository's scripts."""
    text = re.sub(r"(^|\s)#.*$", "", text).strip().removeprefix("$ ")
    for placeholder, value in PLACEHOLDERS.items():
        text = text.replace(placeholder, value)
    try:
        words = shlex.split(text)
    except ValueError:
        return None
    script = next((i for i, w in enumerate(words) if w.endswith(".py") and (ROOT / w).is_file()), None)
    if script is None or not any(w in ("python", "python3", "torchrun") for w in words[:script]):
        return None
    if any(w in TEMPLATE_WORDS or w.endswith("=...") for w in words):
        return None  # a syntax template ("python train.py group=option key=value"), not a command
    return Command(where, words[script], tuple(words[script + 1:]))


def documented_commands() -> list[Command]:
    """Every command that runs one of this repository's scripts, from the shell blocks (backslash continuations
    joined) and the inline code of the README and the docs."""
    commands = []
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT)
        for start, lines in _shell_blocks(text):
            joined, first = "", None
            for offset, line in enumerate(lines):
                first = start + offset if first is None else first
                joined += line.rstrip().removesuffix("\\") + " "
                if not line.rstrip().endswith("\\"):
                    found = _command(joined, f"{name}:{first}")
                    commands += [found] if found else []
                    joined, first = "", None
        for number, line in enumerate(text.splitlines(), start=1):
            for span in re.findall(r"`([^`]+)`", line):
                found = _command(span, f"{name}:{number}")
                commands += [found] if found else []
    return commands


COMMANDS = documented_commands()
TRAIN = [c for c in COMMANDS if c.script == "train.py"]


def _jobs(args: tuple[str, ...]) -> list[list[str]]:
    """The override lists of the jobs a ``train.py`` command runs: one, or every job of a ``-m`` sweep."""
    words, overrides, multirun = list(args), [], False
    while words:
        word = words.pop(0)
        if word in ("-m", "--multirun"):
            multirun = True
        elif word in HYDRA_FLAGS:
            del words[:HYDRA_FLAGS[word]]
        else:
            overrides.append(word)
    if not multirun:
        return [overrides]
    choices = []
    for override in OverridesParser.create().parse_overrides(overrides):
        text = override.input_line
        if override.is_sweep_override():
            key = text.split("=", 1)[0]
            choices.append([f"{key}={value}" for value in override.sweep_string_iterator()])
        else:
            choices.append([text])
    return [list(job) for job in itertools.product(*choices)]


def _compose(config: str, overrides: list[str], tmp_path: Path):
    extra = [f"paths.output_dir={tmp_path}"] if config == "train" else []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name=config, overrides=[*extra, *overrides])


def test_the_pages_quote_the_commands_this_test_checks():
    # The parser finds what the pages show (a parser that finds nothing would make the tests below vacuous).
    scripts = {c.script for c in COMMANDS}
    assert len(TRAIN) > 40
    assert scripts >= {"train.py", "generate.py", "benchmarks/run.py", "benchmarks/strategy_overhead.py"}
    shown = {" ".join(c.args) for c in TRAIN}
    assert {"", "partition=balanced4", "partition=balanced2", "layout=pp4 partition=balanced"} <= shown
    assert any(c.where.startswith("README.md") for c in TRAIN)
    continued = next(c for c in COMMANDS if c.where.startswith("docs/generation.md") and c.script == "generate.py")
    assert "num_samples=5" in continued.args or len(continued.args) > 1  # backslash continuations are joined


@pytest.mark.parametrize("command", TRAIN, ids=str)
def test_every_documented_train_command_composes_and_resolves(command, tmp_path):
    """Each job composes, and the strategy accepts it for the model before anything would launch."""
    for overrides in _jobs(command.args):
        cfg = _compose("train", overrides, tmp_path)
        if cfg.trainer.accelerator in ("gpu", "cuda"):
            continue  # a GPU command composes; building its Trainer needs the GPU
        cfg.trainer.accelerator = "cpu"
        strategy = build_strategy(cfg)
        model = build_model(cfg, strategy, VOCAB)
        build_trainer(cfg, strategy, model)
        rows = cfg.data.batch_size
        strategy.check(model, SimpleNamespace(batch_size=rows, mean_padded_length=20.0, max_tokens=None))


@pytest.mark.parametrize("command", [c for c in COMMANDS if c.script == "generate.py"], ids=str)
def test_every_documented_generate_command_composes(command, tmp_path):
    cfg = _compose("generate", list(command.args), tmp_path)
    assert cfg.ckpt_path


@pytest.mark.parametrize("script", sorted({c.script for c in COMMANDS if c.script.startswith("benchmarks/")}))
def test_every_documented_benchmark_flag_exists(script, monkeypatch, capsys):
    """``python <script> --help`` lists every flag the docs use (run in this process: torch is imported already)."""
    flags = {a.split("=", 1)[0] for c in COMMANDS if c.script == script for a in c.args if a.startswith("--")}
    monkeypatch.setattr(sys, "argv", [script, "--help"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    help_text = capsys.readouterr().out
    assert exited.value.code == 0, help_text[-2000:]
    assert "usage:" in help_text and {f for f in flags if f not in help_text} == set(), script


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stages", [2, 4])
def test_the_design_card_command_trains_a_balanced_pipeline_of_that_many_processes(stages, tmp_path):
    """``python train.py partition=balanced<N>`` alone (here with a few steps of the tiny model): N processes, an
    N-stage balanced pipeline, and its partition report."""
    args = [sys.executable, "train.py", f"partition=balanced{stages}", *TINY_RUN, *SMALL_SYNTHETIC,
            "trainer.limit_train_batches=2", "~callbacks.timeline", f"hydra.run.dir={tmp_path}/run"]
    result = run_command(args, timeout=280)
    assert result.returncode == 0, result.stdout[-4000:]
    assert f"pipeline_parallel_size={stages}" in result.stdout
    report = result.stdout[result.stdout.index("partition (costs by time)"):]
    rows = [line.split() for line in report.splitlines()[3:3 + stages]]
    assert [row[0] for row in rows] == [str(s) for s in range(stages)], report[:2000]
    assert result.stdout.count("validation perplexity") == 1

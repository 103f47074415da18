"""Every command the README and the docs quote works as written: a renamed config group, option or script flag, or a
run that fails at its end, can never again break a documented command unnoticed.

Three levels:

- every ``python train.py ...`` / ``torchrun ... train.py ...`` line of a shell block is composed with Hydra (each
  job of a ``-m`` sweep on its own) and resolved as ``train()`` resolves it before launching anything (strategy,
  meta-built model on the synthetic language's 1,003 words, processes, Trainer and the strategy's checks);
  ``python generate.py ...`` lines compose ``conf/generate.yaml``; ``python benchmarks/<script>.py ...`` lines name
  a script whose ``--help`` lists every flag they use; the generated parts of the pages are up to date;
- the commands the first ten minutes of a new user are made of run for real, as written (a short variant adds only
  step limits; the run directory goes under the test's ``tmp_path``), and their output says what the pages promise:
  :data:`RUN_IN_THE_SUITE`;
- ``python -m pytest -m all_commands tests/test_documented_commands.py`` runs *every* documented command for real
  the same way (about 40 minutes on 2 cores, so not part of the default suite; :data:`NOT_RUN` lists the few that
  cannot run on one CPU machine without a network, and why).
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

from lightning_mp_lstm.app.training import build_model, build_strategy, build_trainer
from tests.helpers import ROOT, run_command

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: The synthetic language's vocabulary (the default data): 1,003 words, not a multiple of 2 unless padded.
VOCAB = 1003
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
    launcher: tuple[str, ...] = ("python",)

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
    if "-m" in words[:script]:
        return None  # a module run (python -m pytest ... tests/x.py), not one of the scripts
    if any(w in TEMPLATE_WORDS or w.endswith("=...") for w in words):
        return None  # a syntax template ("python train.py group=option key=value"), not a command
    return Command(where, words[script], tuple(words[script + 1:]), tuple(words[:script]))


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
    assert scripts >= {"train.py", "generate.py", "benchmarks/run.py", "benchmarks/overhead.py"}
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


def test_the_generated_parts_of_the_pages_are_up_to_date():
    """The strategy's options table, the recorded runs' figures and the measured comparison equal what their
    sources give (``python docs/generated.py`` rewrites them)."""
    generated = runpy.run_path(str(ROOT / "docs" / "generated.py"))
    assert generated["stale"]() == []
    pages = "".join(page.read_text() for page in generated["PAGES"])
    assert {m.group("name") for m in generated["BLOCK"].finditer(pages)} == set(generated["GENERATORS"])
    # A record's command is one the README shows, exactly.
    readme = {" ".join(c.args) for c in TRAIN if c.where.startswith("README.md")}
    for name, command in generated["COMMANDS"].items():
        assert command.removeprefix("python train.py").strip() in readme, name
        assert generated["load"](name)["command"] == command, name


# ----- running the documented commands for real ----------------------------------------------------------------
#: What a short variant adds to a ``train.py`` command that trains long: step limits only.
STEP_LIMITS = ("trainer.max_steps=3", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2")
#: The documented commands the default suite runs for real (the first ten minutes of a new user): the README's
#: main job (:func:`main_job`, also the design card's ``partition=balanced2``: a 2-stage balanced pipeline) and
#: these, as ``script args``. ``layout=pp2_tp2`` (4 processes, a minute here) runs with ``-m all_commands``; the
#: tensor-parallel tests cover its layout in process.
RUN_IN_THE_SUITE = (
    "train.py trainer.max_steps=3 evaluate=false",
    "train.py layout=tp2",
    "train.py partition=balanced4",
    "generate.py ckpt_path=outputs/2026-01-01/00-00-00/checkpoints/last.ckpt num_samples=5 temperature=0.8 top_k=50",
)
#: Documented commands that cannot run on one CPU machine without a network (``-m all_commands`` leaves them out).
NOT_RUN = {
    "train.py data=ptb data.download=true": "downloads PTB: the test machines have no network",
    "train.py layout=dp2_pp2 trainer.num_nodes=2": "needs two machines",
    "train.py layout=dp2_pp2 trainer.num_nodes=2 data=ptb data.path=/shared/ptb model=medium": "needs two machines",
    "train.py trainer.accelerator=gpu layout=pp4 trainer.precision=bf16-mixed": "needs 4 GPUs",
}


def _key(command: Command) -> str:
    return f"{command.script} {' '.join(command.args)}".strip()


def _stand_ins(tmp: Path, checkpoint: Path | None) -> dict[str, str]:
    """Paths a command names that do not exist here, and what stands in for them: PTB files made of the shared valid
    and test splits, output directories under ``tmp``, and the main job's checkpoint for ``outputs/<date>/<time>``."""
    from tests.helpers import ptb_dir

    ptb, wiki = tmp / "ptb", tmp / "wikitext-2"
    if not ptb.exists():
        ptb.mkdir(parents=True)
        wiki.mkdir(parents=True)
        for split, source in (("train", "valid"), ("valid", "valid"), ("test", "test")):
            text = (ptb_dir() / f"ptb.{source}.txt").read_text()
            (ptb / f"ptb.{split}.txt").write_text(text)
            (wiki / f"wiki.{split}.tokens").write_text(text)
    out = {"/data/ptb": ptb, "/path/to/ptb": ptb, "/shared/ptb": ptb, "/path/to/wikitext-2": wiki,
           "/path/to/wikitext-103": wiki,
           "/scratch/checkpoints": tmp / "scratch", "/shared/tensorboard/run1": tmp / "tensorboard",
           "runs/first": tmp / "runs-first", "sweeps/layouts": tmp / "sweeps"}
    for folder in ("/data", "/d", "/data/ptb"):
        for split in ("train", "valid", "test"):
            out[f"{folder}/ptb.{split}.txt"] = ptb / f"ptb.{split}.txt"
    if checkpoint is not None:
        out["outputs/2026-01-01/00-00-00/checkpoints/last.ckpt"] = checkpoint
    return {k: str(v) for k, v in out.items()}


def _as_run(command: Command, tmp: Path, checkpoint: Path | None = None) -> list[str]:
    """The command line to run: as written, placeholders stood in for, and for ``train.py`` the step limits and a
    run directory under ``tmp`` (unless the command sets one)."""
    stand_ins = _stand_ins(tmp, checkpoint)
    args = []
    for arg in command.args:
        key, _, value = arg.partition("=")
        args.append(f"{key}={stand_ins.get(value, value)}" if value else stand_ins.get(arg, arg))
    if command.script == "train.py" and not {"--help", "--cfg"} & set(args):
        limits = [*STEP_LIMITS] if not any(a.startswith("ckpt_path=") for a in args) else [
            "trainer.max_steps=6", *STEP_LIMITS[1:]]
        args = [re.sub(r"^hydra\.sweeper\.n_trials=\d+$", "hydra.sweeper.n_trials=2", a) for a in args]
        args += [limit for limit in limits if limit.split("=")[0] not in {a.split("=")[0] for a in args}]
        if "hydra.sweeper.n_trials=2" not in args and "hparams_search=lstm_optuna" in args:
            args.append("hydra.sweeper.n_trials=2")
        for key, folder in (("hydra.run.dir", "run"), ("hydra.sweep.dir", "sweep")):
            if not any(a.startswith(f"{key}=") for a in args):
                args.append(f"{key}={tmp / folder}")
    if command.launcher[0] == "torchrun":
        return [sys.executable, "-m", "torch.distributed.run", *command.launcher[1:], command.script, *args]
    return [sys.executable, command.script, *args]


def _jobs_of(command: Command) -> int:
    return 2 if any("hparams_search" in a for a in command.args) else len(_jobs(command.args))


def _tables(output: str) -> list[dict[str, str]]:
    """The closing tables in a run's output (each ``label -> value``)."""
    lines, tables = output.splitlines(), []
    rules = [i for i, line in enumerate(lines) if re.fullmatch(r"-{60,}", line.strip())]
    for start, end in zip(rules, rules[1:]):
        if start + 1 < end and lines[start + 1].startswith(("validation perplexity", "evaluated weights")):
            tables.append(dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[start + 1:end]))
    return tables


def _check_quiet(output: str) -> None:
    """No Python warning (``file.py:N: ...`` or ``...Warning:``), no Lightning tip, and each logged warning once:
    what remains is what the user can act on, said once."""
    assert "💡" not in output, output[-3000:]
    lines = output.splitlines()
    shown = [line for line in lines if re.match(r"^\S+\.py:\d+: ", line) or re.search(r"\w+Warning:", line)]
    assert shown == [], shown
    logged = [re.sub(r"^\[[^]]*\]", "", line) for line in lines if "][WARNING] - " in line]
    assert len(logged) == len(set(logged)), logged


def _check_promised_output(command: Command, output: str) -> None:
    """What the pages promise a command prints."""
    args = set(command.args)
    if command.script == "generate.py":
        samples = int(next(a for a in command.args if a.startswith("num_samples=")).split("=")[1])
        assert len([line for line in output.splitlines() if line.strip()]) == samples, output[-2000:]
    elif command.script == "train.py" and "--help" in args:
        assert "Powered by Hydra" in output and "layout: " in output
    elif command.script == "train.py" and "--cfg" in args:
        assert "model:" in output and "strategy:" in output
    elif command.script == "train.py":
        tables = _tables(output)
        assert len(tables) == _jobs_of(command), output[-3000:]  # one closing table per job, printed once
        for table in tables:
            if "evaluate=false" in args:
                assert table["evaluated weights"] == "none (evaluate=false)", table
            else:
                assert float(table["test perplexity"].replace(",", "")) > 1, table
            assert float(table["train tokens / s"].replace(",", "")) > 0, table
        _check_quiet(output)
    else:
        assert re.search(r"^final loss: \S+$", output, re.MULTILINE), output[-2000:]


def _run(command: Command, tmp: Path, checkpoint: Path | None = None, timeout: float = 280) -> str:
    result = run_command(_as_run(command, tmp, checkpoint), timeout=timeout)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-4000:]}"
    _check_promised_output(command, result.stdout)
    return result.stdout


@pytest.fixture(scope="module")
def main_job(tmp_path_factory) -> tuple[str, Path]:
    """The README's main job, ``python train.py``, run once (short: step limits) for the tests that read its output
    or use its checkpoint."""
    tmp = tmp_path_factory.mktemp("main_job")
    command = next(c for c in TRAIN if c.where.startswith("README.md") and not c.args)
    return _run(command, tmp, timeout=280), tmp / "run"


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_the_main_job_runs_quietly_and_prints_what_the_readme_promises(main_job):
    """``python train.py``: the autopilot's ranking and the layout it chose, the whole model's summary, the closing
    table; no warning the project causes, and each message once, from rank 0."""
    output, run = main_job
    (table,) = _tables(output)
    assert float(table["synthetic floor (true model)"]) == pytest.approx(71.80, abs=0.01)
    assert table["checkpoint"] == str(run / "checkpoints" / "last.ckpt") and Path(table["checkpoint"]).is_file()
    assert (run / "timeline.png").stat().st_size > 0
    (chosen,) = [line for line in output.splitlines() if line.rstrip().endswith("  chosen")]
    name, processes = re.split(r"\s{2,}", chosen)[:2]
    assert f"mp_lstm: training on {name}" in output
    dp = 2 if name.startswith("dp2") else 1
    pp = int(processes) // dp
    assert f"ParallelLayout(data_parallel_size={dp}, pipeline_parallel_size={pp}," in output
    report = output[re.search(r"partition \(costs by \w+\)", output).start():]
    assert [line.split()[0] for line in report.splitlines()[3:3 + pp]] == [str(s) for s in range(pp)], report[:1500]
    for once in ("corpus synthetic:", "bucket lengths:", "GPU available:", "Initializing distributed:",
                 "mp_lstm: layout=auto ranked", "partition (costs by", "Total params:"):
        assert output.count(once) == 1, (once, output[-4000:])
    # The summary counts the whole model (both stages), FLOPs of its LSTM layers included.
    assert re.search(r"Total params: 523 K", output) and re.search(r"Total FLOPs: [1-9][\d.]* [MG]", output)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("key", RUN_IN_THE_SUITE)
@pytest.mark.processes
def test_the_first_ten_minutes_commands_run_as_written(key, main_job, tmp_path):
    """Exit status 0 and the promised output; the generate command samples from the main job's checkpoint."""
    command = next(c for c in COMMANDS if _key(c) == key)
    output = _run(command, tmp_path, checkpoint=main_job[1] / "checkpoints" / "last.ckpt")
    stages = re.match(r"train\.py partition=balanced(\d)$", key)
    if stages:  # the design card's command: an N-stage balanced pipeline on N processes, and its report
        n = int(stages.group(1))
        assert f"pipeline_parallel_size={n}" in output
        report = output[output.index("partition (costs by time)"):]
        rows = [line.split() for line in report.splitlines()[3:3 + n]]
        assert [row[0] for row in rows] == [str(s) for s in range(n)], report[:2000]
    if "tp2" in key:
        assert "tensor_parallel_size=2" in output and "decoder split /2" in output


def test_the_lists_of_commands_name_documented_commands():
    documented = {_key(c) for c in COMMANDS}
    assert set(RUN_IN_THE_SUITE) <= documented
    assert set(NOT_RUN) <= documented, set(NOT_RUN) - documented


def _every_command() -> list[Command]:
    seen, out = set(), []
    for command in COMMANDS:
        key = (command.launcher[0], _key(command))
        if key in seen or _key(command) in NOT_RUN or command.script.startswith("benchmarks/"):
            continue  # benchmark scripts: their flags are checked above; they measure for minutes
        if command.script == "docs/generated.py":
            continue  # it rewrites the pages; its --check runs in the default suite (generated parts up to date)
        seen.add(key)
        out.append(command)
    return out


@pytest.mark.all_commands
@pytest.mark.timeout(900)
@pytest.mark.parametrize("command", _every_command(), ids=str)
@pytest.mark.processes
def test_every_documented_command_runs_as_written(command, main_job, tmp_path):
    _run(command, tmp_path, checkpoint=main_job[1] / "checkpoints" / "last.ckpt", timeout=880)

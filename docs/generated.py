"""The parts of the README and the docs that are generated, so that they cannot go stale.

A generated part sits between ``<!-- generated: NAME -->`` and ``<!-- end generated -->`` in a Markdown page and is
rewritten from its source alone:

- ``strategy-options``: the options table of ``docs/strategy.md``, from ``MPLSTMStrategy``'s signature (defaults)
  and its docstring's ``Args:`` (meanings);
- ``main-job-*``: figures of ``python train.py`` (the README's main job), from ``docs/records/main_job.json``;
- ``ptb-*``: figures of the README's PTB command, from ``docs/records/ptb.json``;
- ``when-to-use``: the comparison table of ``docs/when_to_use.md``, from ``benchmarks/when_to_use.json``;
- ``layers``: the table of the package's layers in ``docs/architecture.md``, from the ``layers`` contract in
  ``pyproject.toml`` and the package's files and imports (``docs/layers.py``, which also draws the picture).

A record holds the command exactly as the README gives it, the date, the machine, the wall time and the run's
closing table. Commands::

    python docs/generated.py                  # rewrite every generated part from the records (no run)
    python docs/generated.py --record main_job   # run the README's main job, record it, rewrite
    python docs/generated.py --record ptb        # the same for the PTB command
    python docs/generated.py --check          # exit 1 (naming the parts) if a page differs from its sources

``tests/test_documented_commands.py`` runs the check.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import inspect
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "records"
WHEN_TO_USE = ROOT / "benchmarks" / "when_to_use.json"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)

#: The recorded runs: the command exactly as the README shows it.
COMMANDS = {
    "main_job": "python train.py",
    "ptb": ("python train.py data=ptb data.train=data/ptb/ptb.valid.txt "
            "data.valid=data/ptb/ptb.test.txt data.test=data/ptb/ptb.test.txt buckets=mxnet "
            "model=small trainer.max_epochs=6 ~callbacks.model_checkpoint"),
}
#: The strategy's arguments that Lightning's Trainer fills in (not options a user sets).
LIGHTNING_ARGUMENTS = ("accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin")


# ----- recording ---------------------------------------------------------------------------------------------
def _machine() -> dict[str, Any]:
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").is_file():
        names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                 if line.startswith("model name")]
        cpu = names[0] if names else cpu
    return {"cpu": cpu, "cores": os.cpu_count(), "torch": torch.__version__, "lightning": lightning.__version__,
            "python": platform.python_version()}


def closing_table(output: str) -> dict[str, str]:
    """The rows of the last closing table in a run's output (``label: value``)."""
    lines = output.splitlines()
    rules = [i for i, line in enumerate(lines) if re.fullmatch(r"-{40,}", line.strip())]
    if len(rules) < 2:
        raise ValueError("the output holds no closing table")
    start, end = rules[-2], rules[-1]
    return dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in lines[start + 1:end] if line.strip())


def record(name: str) -> dict[str, Any]:
    """Run ``COMMANDS[name]`` from the repository root as written, and store what the pages quote from it."""
    command = COMMANDS[name]
    load_before = os.getloadavg()
    started = time.perf_counter()
    result = subprocess.run(shlex.split(command), cwd=ROOT, capture_output=True, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    wall = time.perf_counter() - started
    if result.returncode:
        raise SystemExit(f"{command} exited with {result.returncode}:\n{result.stdout[-3000:]}{result.stderr[-3000:]}")
    table = {key: value.replace(f"{ROOT}{os.sep}", "") for key, value in closing_table(result.stdout).items()}
    data = {"command": command, "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "wall_s": round(wall, 1), "machine": _machine(), "load_before": [round(x, 2) for x in load_before],
            "load_after": [round(x, 2) for x in os.getloadavg()], "table": table}
    RECORDS.mkdir(parents=True, exist_ok=True)
    (RECORDS / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    return data


def load(name: str) -> dict[str, Any]:
    """A stored record (``docs/records/<name>.json``)."""
    return json.loads((RECORDS / f"{name}.json").read_text())


# ----- rendering ---------------------------------------------------------------------------------------------
def _minutes(seconds: float) -> str:
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes} min {rest} s" if minutes else f"{rest} s"


def _day(record: dict[str, Any]) -> str:
    return record["date"][:10]


def _machine_text(record: dict[str, Any]) -> str:
    m = record["machine"]
    load = ", ".join(f"{x:.1f}" for x in record["load_before"])
    return (f"{m['cores']} CPU cores ({m['cpu']}), torch {m['torch']}, Lightning {m['lightning']}; load average "
            f"{load} before the run")


def main_job_figures() -> str:
    r = load("main_job")
    t = r["table"]
    training = float(t["training time (s)"].replace(",", ""))
    return (f"Recorded {_day(r)} (`{r['command']}`): {_minutes(r['wall_s'])} from start to the table on a 2-core "
            f"machine shared with other work (load average {r['load_before'][0]:.1f} before the run), {training:.0f} s "
            f"of it training; test perplexity {t['test perplexity']} against the language's floor of "
            f"{t['synthetic floor (true model)']}.\n")


def main_job_table() -> str:
    r = load("main_job")
    width = max(len(k) for k in r["table"])
    rows = "\n".join(f"{k:<{width}}  {v}" for k, v in r["table"].items())
    rule = "-" * (width + 40)
    return (f"```text\n{rule}\n{rows}\n{rule}\n```\n\n(`{r['command']}` as recorded on {_day(r)}: "
            f"{_minutes(r['wall_s'])} wall clock in all on {_machine_text(r)}. Generated from "
            "`docs/records/main_job.json` by `python docs/generated.py`.)\n")


def ptb_figures() -> str:
    r = load("ptb")
    t = r["table"]
    return (f"test perplexity {t['test perplexity']} after 6 epochs (unigram baseline {t['unigram baseline']}), "
            f"{_minutes(r['wall_s'])} on 2 CPU cores (load average {r['load_before'][0]:.1f} before the run); "
            f"recorded {_day(r)}.\n")


def _markdown(text: str) -> str:
    """A docstring's reStructuredText roles and literals as Markdown."""
    text = re.sub(r":(?:class|func|meth|attr|mod|data):`~?([^`]+)`", lambda m: f"`{m.group(1).split('.')[-1]}`", text)
    return text.replace("``", "`").replace("|", "\\|")


def docstring_args(obj: Any) -> dict[str, str]:
    """``name -> meaning`` from the ``Args:`` section of a Google-style docstring (continuation lines joined)."""
    doc = inspect.getdoc(obj) or ""
    args: dict[str, str] = {}
    inside, current = False, None
    for line in doc.splitlines():
        if line.strip() == "Args:":
            inside = True
            continue
        if inside and line and not line.startswith(" "):
            break
        found = re.match(r"^ {4}(\w+): (.*)$", line)
        if inside and found:
            current = found.group(1)
            args[current] = found.group(2)
        elif inside and current and line.startswith("        "):
            args[current] += " " + line.strip()
    return args


def strategy_options() -> str:
    from lightning_mp_lstm import MPLSTMStrategy

    meanings = docstring_args(MPLSTMStrategy)
    rows = ["| Argument | Default | Meaning |", "|---|---|---|"]
    for name, parameter in inspect.signature(MPLSTMStrategy.__init__).parameters.items():
        if name == "self" or name in LIGHTNING_ARGUMENTS:
            continue
        if name not in meanings:
            raise ValueError(f"MPLSTMStrategy's docstring does not describe its argument {name!r}")
        default = parameter.default
        shown = f'"{default}"' if isinstance(default, str) else repr(default)
        rows.append(f"| `{name}` | `{shown}` | {_markdown(meanings[name])} |")
    note = "Generated from `MPLSTMStrategy`'s signature and docstring by `python docs/generated.py`."
    return "\n".join(rows) + f"\n\n{note}\n"


def when_to_use() -> str:
    from benchmarks.when_to_use import render

    return render(json.loads(WHEN_TO_USE.read_text()))


def layers() -> str:
    spec = importlib.util.spec_from_file_location("docs_layers", ROOT / "docs" / "layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.table()


GENERATORS: dict[str, Callable[[], str]] = {
    "strategy-options": strategy_options, "main-job-figures": main_job_figures, "main-job-table": main_job_table,
    "ptb-figures": ptb_figures, "when-to-use": when_to_use, "layers": layers,
}


def rendered(text: str) -> str:
    """``text`` with every generated part rewritten from its source."""
    def replace(match: re.Match) -> str:
        name = match.group("name")
        if name not in GENERATORS:
            raise ValueError(f"unknown generated part {name!r}; known: {', '.join(GENERATORS)}")
        return f"{match.group(1)}{GENERATORS[name]()}{match.group(4)}"

    return BLOCK.sub(replace, text)


def stale() -> list[str]:
    """The pages (with their generated parts' names) that differ from what their sources give."""
    out = []
    for page in PAGES:
        text = page.read_text()
        if rendered(text) != text:
            names = sorted({m.group("name") for m in BLOCK.finditer(text)})
            out.append(f"{page.relative_to(ROOT)} ({', '.join(names)})")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", choices=sorted(COMMANDS), action="append", default=[],
                        help="run this recorded command first (as the README gives it) and store its record")
    parser.add_argument("--check", action="store_true", help="only check: exit 1 if a page is stale")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.check:
        found = stale()
        print("\n".join(found) if found else "every generated part is up to date")
        return 1 if found else 0
    for name in args.record:
        print(f"recording {name}: {COMMANDS[name]}", flush=True)
        record(name)
    for page in PAGES:
        text = page.read_text()
        new = rendered(text)
        if new != text:
            page.write_text(new)
            print(f"rewrote {page.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

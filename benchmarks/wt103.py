"""A WikiText-103-sized job on this machine: ``python train.py`` runs, each process's memory sampled, against the
memory plan each run printed.

The corpus is one ``benchmarks/wikitext_shaped.py`` writes (100 M training tokens, 267,735 words; the real one cannot
be downloaded here); its token cache goes to a folder of its own, empty for the first run (cold) and kept for the
next (warm). Every run is a real ``train.py`` command in its own session; a sampler reads ``/proc/<pid>/status``
of every process of the session every 50 ms: its peak anonymous memory (``RssAnon``, what the kernel's OOM killer
weighs; the memory-mapped corpus is file-backed) and its ``VmHWM``. The runs:

* ``python train.py data=wikitext data.path=<corpus> layout=pp2 trainer.max_steps=2``, cold then warm (the issue's
  command: the configs' tiny model, whose ``softmax: auto`` is adaptive for 267,735 words);
* the same with ``layout=single``: it trains or is refused before launch with the memory table, never killed;
* ``experiment=wt103`` (embedding 400, 4 x 1024, adaptive softmax) on pp2, ``trainer.max_steps=4 evaluate=false``:
  its seconds per step and each process's peak against the memory plan's prediction.

Goals (issue 43): every run exits 0 (or, for one process, refuses before launch); every process's anonymous memory
<= 4 GiB; the warm pp2 run <= 180 s from start to end; the memory plan within 20 % of each process's measured peak
(``VmHWM``).

    python benchmarks/wt103.py --corpus corpora/wt103 [--cache corpora/cache] [--json benchmarks/wt103.json]
                               [--results benchmarks/results.json]

``--results`` adds the runs as the ``wikitext103`` section of the benchmarks' results (rendered on
docs/results.md by ``python benchmarks/run.py --render docs/results.md``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20
GOAL_ANON_MIB = 4 * 1024
GOAL_WARM_S = 180.0


def _status(pid: int) -> dict[str, int] | None:
    """``RssAnon``, ``VmHWM`` and ``VmRSS`` of a process (KiB), or ``None`` once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in status)
                    if k in ("RssAnon", "VmHWM", "VmRSS")}
    except (OSError, ValueError):
        return None


def _session_members(sid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid:  # after the name: state, ppid, pgrp, session
            members.append(int(entry))
    return members


def run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``python train.py <args>`` in its own session, sampling every process of it.

    Returns:
        ``returncode``, ``seconds``, ``output`` (the last 6,000 characters), and per process (by pid, the launching
        one first) its peak ``anon_mib`` and ``hwm_mib``.
    """
    started = time.perf_counter()
    process = subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    peaks: dict[int, dict[str, float]] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            for pid in _session_members(process.pid):
                status = _status(pid)
                if status is None:
                    continue
                peak = peaks.setdefault(pid, {"anon_mib": 0.0, "hwm_mib": 0.0})
                peak["anon_mib"] = max(peak["anon_mib"], status.get("RssAnon", 0) / 1024)
                peak["hwm_mib"] = max(peak["hwm_mib"], status.get("VmHWM", 0) / 1024)
            done.wait(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
    done.set()
    sampler.join()
    return {"returncode": process.returncode, "seconds": time.perf_counter() - started, "output": output[-6000:],
            "processes": [peaks[pid] for pid in sorted(peaks, key=lambda p: (p != process.pid, p))
                          if peaks[pid]["hwm_mib"] > 100]}  # python processes, not a shell's


def predicted(output: str) -> list[float]:
    """The peaks (MiB) of the memory table a run printed, by pipeline rank."""
    table = output.split("memory per process (MiB, predicted peak", 1)
    if len(table) < 2:
        return []
    rows = [line.split() for line in table[1].splitlines()[3:]]
    peaks = []
    for cells in rows:
        if not cells or not cells[0].isdigit():
            break
        peaks.append(float(cells[-1].replace(",", "")))
    return peaks


def seconds_per_step(output: str) -> float | None:
    """The step time the run's partition report measured (``step with m=...: ... measured X ms``)."""
    found = re.findall(r"measured ([\d.]+) ms", output)
    return float(found[-1]) / 1000 if found else None


def section(runs: dict[str, dict[str, Any]], date: str) -> dict[str, Any]:
    """The runs as the ``wikitext103`` section of the results (``benchmarks/schema.py``): a row per run, the goals."""
    def shown(command: str) -> str:  # as a user types it: the corpus's folder as the docs name it, no scratch
        kept = [a for a in command.split() if not a.startswith(("hydra.run.dir=", "trainer.enable_progress",
                                                                "data.cache_dir="))]
        return " ".join(re.sub(r"^data\.path=.*", "data.path=/path/to/wikitext-103", a) for a in kept)

    rows = [{"run": name, "command": shown(r["command"]), "exit": r["returncode"], "seconds": r["seconds"],
             "anon_mib": [p["anon_mib"] for p in r["processes"]], "hwm_mib": [p["hwm_mib"] for p in r["processes"]],
             "predicted_mib": r["predicted_mib"] or None, "step_s": r["seconds_per_step"]} for name, r in runs.items()]
    errors = [abs(p / r["processes"][i]["hwm_mib"] - 1) for r in runs.values() if r["returncode"] == 0
              for i, p in enumerate(r["predicted_mib"]) if i < len(r["processes"])]
    goals = [_goal("runs that did not exit 0", sum(r["returncode"] != 0 for r in runs.values()), 0, "<="),
             _goal("largest anonymous memory of any process (MiB)",
                   max(p["anon_mib"] for r in runs.values() for p in r["processes"]), GOAL_ANON_MIB, "<="),
             _goal("warm pp2 run, start to end (s)", runs["pp2 warm"]["seconds"], GOAL_WARM_S, "<=")]
    if errors:
        goals.append(_goal("memory plan: largest |predicted / measured VmHWM - 1| of any process", max(errors), 0.20,
                           "<="))
    return {"title": "WikiText-103 on one machine",
            "setup": ("benchmarks/wt103.py: real train.py runs on a WikiText-103-shaped corpus "
                      "(benchmarks/wikitext_shaped.py: 100 M training tokens, 267,738 words), each in its own "
                      "session, every process's /proc/<pid>/status sampled every 50 ms; rank 0 first. The token "
                      "cache (data.cache_dir) in a folder of its own: empty for the cold run, kept for the next. "
                      f"Measured {date}. docs/wikitext103.md."),
            "rows": rows, "goals": goals}


def _goal(name: str, value: float, target: float, op: str) -> dict[str, Any]:
    met = value >= target if op == ">=" else value <= target
    return {"name": name, "value": float(value), "target": float(target), "op": op, "met": bool(met)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", type=Path, required=True, help="a folder of wikitext_shaped.py (wiki.*.tokens)")
    parser.add_argument("--cache", type=Path, default=None, help="the token cache (default: a new temporary one)")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--results", type=Path, default=None, help="add the wikitext103 section to these results")
    args = parser.parse_args()
    cache = args.cache or Path(tempfile.mkdtemp(prefix="wt103-cache-"))
    shutil.rmtree(cache, ignore_errors=True)
    with tempfile.TemporaryDirectory() as scratch:
        common = [f"data.path={args.corpus}", f"data.cache_dir={cache}", "trainer.enable_progress_bar=false"]
        runs = {}
        for name, extra in (("pp2 cold", ["layout=pp2", "trainer.max_steps=2"]),
                            ("pp2 warm", ["layout=pp2", "trainer.max_steps=2"]),
                            ("single", ["layout=single", "trainer.max_steps=2"]),
                            ("wt103 pp2", ["experiment=wt103", "trainer.max_steps=6", "evaluate=false",
                                           "strategy.report_after_steps=4"])):
            data = ["data=wikitext"] if not name.startswith("wt103") else []
            command = [*data, *common, *extra, f"hydra.run.dir={scratch}/{name.replace(' ', '_')}"]
            print(f"python train.py {' '.join(command)}", flush=True)
            result = run(command, args.timeout)
            result["command"] = "python train.py " + " ".join(command)
            result["predicted_mib"] = predicted(result["output"])
            result["seconds_per_step"] = seconds_per_step(result["output"])
            runs[name] = result
            print(f"  exit {result['returncode']} in {result['seconds']:.0f} s; per process (MiB anon / VmHWM): "
                  + ", ".join(f"{p['anon_mib']:,.0f} / {p['hwm_mib']:,.0f}" for p in result["processes"])
                  + (f"; predicted {result['predicted_mib']}" if result["predicted_mib"] else ""), flush=True)
    print("\n| run | exit | seconds | per process: peak anonymous / VmHWM MiB | memory plan's peak MiB | s/step |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, r in runs.items():
        per = "; ".join(f"{p['anon_mib']:,.0f} / {p['hwm_mib']:,.0f}" for p in r["processes"])
        plan = ", ".join(f"{v:,.0f}" for v in r["predicted_mib"]) or "-"
        step = f"{r['seconds_per_step']:.2f}" if r["seconds_per_step"] else "-"
        print(f"| {name} | {r['returncode']} | {r['seconds']:.0f} | {per} | {plan} | {step} |")
    anon = max(p["anon_mib"] for r in runs.values() for p in r["processes"])
    print(f"\nlargest anonymous memory of any process: {anon:,.0f} MiB (goal <= {GOAL_ANON_MIB:,})")
    print(f"warm pp2 run: {runs['pp2 warm']['seconds']:.0f} s (goal <= {GOAL_WARM_S:.0f})")
    errors = [p / r["processes"][i]["hwm_mib"] - 1 for r in runs.values() if r["returncode"] == 0
              for i, p in enumerate(r["predicted_mib"]) if i < len(r["processes"])]
    if errors:
        print(f"memory plan: predicted / measured VmHWM - 1 from {min(errors):+.1%} to {max(errors):+.1%} "
              "(goal within 20 %)")
    if args.json:  # no folder of this machine's in a file the repository keeps
        kept = json.dumps({"date": time.strftime("%Y-%m-%d"), "corpus": "<corpus>", "runs": runs}, indent=2)
        for folder, name in ((scratch, "<scratch>"), (cache, "<cache>"), (args.corpus, "<corpus>")):
            kept = kept.replace(str(folder), name)
        args.json.write_text(kept)
    if args.results:
        results = json.loads(args.results.read_text())
        results["sections"]["wikitext103"] = section(runs, time.strftime("%Y-%m-%d"))
        args.results.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""The autopilot against measurement: for each job, ``layout=auto``'s ranking, then every candidate that fits measured
by running it by hand, and the pick against the best measured.

For every job (``train.py`` overrides), a fresh process builds what ``train.py`` builds before launch (data,
strategy, model on the meta device) and ranks the layouts as ``layout=auto`` does
(:func:`lightning_mp_lstm.app.autopilot.rank_run`; fresh, so that its floor of memory is a ``train.py`` process's).
Then each candidate that fits runs as its own ``python train.py`` with its layout set by hand
(:func:`~lightning_mp_lstm.app.autopilot.layout_overrides`), recording ``--first + --steps`` steps with the timeline;
its seconds per step in a run is the mean of the recorded steps from ``--first`` on, each bucket's first step left
out (it builds that shape's stages). The prediction is for the mean padded length, so the mean (not the median) is
what it predicts. Each candidate runs ``--rounds`` times, the candidates taking turns, and its measured step is the
median of its runs (on a shared machine one run of a 40 ms step moved by a third). A job where nothing fits is
reported with no measurement.

Goals (issue 44): on every job the pick's measured step at most 1.10 x the best measured; every prediction within
25 % of its measurement (``predicted / measured`` from 0.75 to 1.25).

    python benchmarks/autopilot.py [--jobs main mxnet_ptb long vocab] [--first 5] [--steps 30] [--rounds 3]
                                   [--json FILE] [--results benchmarks/results.json] [--override layout.processes=4]

``--override`` adds ``train.py`` overrides to every job (on a machine of many cores, ``layout.processes=4`` keeps the
candidates to 4 processes; on a GPU machine, ``trainer.accelerator=cpu`` ranks the CPU layouts).

``--results`` adds the jobs as the ``autopilot`` section of the benchmarks' results (rendered on docs/results.md by
``python benchmarks/run.py --render docs/results.md``). A run of some jobs replaces those jobs in an existing
``--json`` file and keeps the others, each job with its own date and command (:func:`merge_jobs`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.main_job import measure  # noqa: E402

__all__ = ["JOBS", "job_label", "main", "mean_step", "merge_jobs", "most_processes", "rank_job", "section"]

#: The jobs: ``train.py`` overrides. ``vocab``'s budget lets a pipeline of two processes hold its 50,000-word
#: decoder and refuses one process and replicas that do not shard (1.2 GiB until the ranking read its floor before
#: its timing runs; the plans then came out 160 MiB lower and one process fitted).
JOBS: dict[str, list[str]] = {
    "main": [],
    "mxnet_ptb": ["model=mxnet_ptb"],
    "long": ["data.mode=stream", "data.bptt=200", "data.batch_size=8"],
    "vocab": ["data.synthetic.vocab_size=50000", "model.softmax=full", "model.hidden_size=256",
              "model.embedding_dim=256", "strategy.memory_per_process=1.05"],
}


def rank_job(overrides: list[str]) -> tuple[list[Any], str]:
    """``layout=auto``'s ranking of the job, as ``train.py`` would print it (in this process)."""
    from hydra import compose, initialize_config_dir

    from lightning_mp_lstm.app import autopilot
    from lightning_mp_lstm.app.training import _build, build_model, build_strategy

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    strategy = build_strategy(cfg)
    datamodule = _build(cfg.data, "data")
    datamodule.prepare_data()
    datamodule.setup("fit")
    model = build_model(cfg, strategy, datamodule.vocab_size)
    return autopilot.rank_run(cfg, strategy, model, datamodule)


def mean_step(rows: list[dict[str, float]], first: int) -> float:
    """Mean seconds per step from step ``first`` on, each shape's first step of the run left out."""
    seen: set[float] = set()
    kept = []
    for row in rows:
        new = row["elements"] not in seen
        seen.add(row["elements"])
        if row["step"] >= first and not new:
            kept.append(row["step_s"])
    return statistics.mean(kept)


def _print_ranking(overrides: list[str]) -> None:
    """``--rank JOB``: the job's ranking as one JSON line (the table before it)."""
    from lightning_mp_lstm.planning.autopilot import choose

    ranked, table = rank_job(overrides)
    chosen = choose(ranked)
    print(table)
    print(json.dumps([{"candidate": r.name, "processes": r.processes, "predicted_s": r.candidate.predicted_seconds,
                       "fits": r.fits, "peak_mib": r.memory.peak / 2**20 if r.memory is not None else None,
                       "chosen": r is chosen, "settings": r.settings()} for r in ranked]), flush=True)


def run_job(name: str, overrides: list[str], first: int, steps: int, rounds: int = 1) -> dict[str, Any]:
    """Rank the job, then run each candidate that fits ``rounds`` times, the candidates taking turns (a machine
    that slows for a while slows each of them); a candidate's measured step is the median of its runs' means."""
    from lightning_mp_lstm.app.autopilot import layout_overrides

    started = time.perf_counter()
    extra = [f"--override={o}" for o in overrides if o not in JOBS[name]]
    done = subprocess.run([sys.executable, __file__, "--rank", name, *extra], cwd=ROOT, check=True,
                          capture_output=True, text=True)
    lines = done.stdout.splitlines()
    ranked = json.loads(lines[-1])
    print("\n".join(line for line in lines[:-1] if not line.startswith("[")), flush=True)
    calibrated = next((line for line in lines if line.startswith("calibrated: ")), "")
    rows = [{"candidate": option["candidate"], "processes": option["processes"], "predicted_s": option["predicted_s"],
             "predicted_rank": rank, "fits": option["fits"], "peak_mib": option["peak_mib"],
             "chosen": option["chosen"]} for rank, option in enumerate(ranked, 1)]
    commands = {i: [*overrides, *layout_overrides(option["settings"])] for i, option in enumerate(ranked)
                if option["fits"]}
    for _ in range(rounds):
        for i, command in commands.items():
            rows[i].setdefault("measured_rounds", []).append(mean_step(measure(first, steps, command), first))
            print(json.dumps(rows[i]), flush=True)
    for i, command in commands.items():
        row = rows[i]
        row["measured_s"] = statistics.median(row["measured_rounds"])
        row["predicted_over_measured"] = row["predicted_s"] / row["measured_s"]
        row["overrides"] = " ".join(command)
    measured = [r for r in rows if "measured_s" in r]
    if not measured:
        raise SystemExit(f"{name}: no layout fits (the ranking above); nothing to measure")
    best = min(r["measured_s"] for r in measured)
    pick = next(r for r in measured if r["chosen"])
    errors = [r["predicted_over_measured"] for r in measured]
    return {
        "job": name, "overrides": overrides, "rounds": rounds, "calibrated": calibrated.removeprefix("calibrated: "),
        "rows": rows, "pick": pick["candidate"],
        "best": min(measured, key=lambda r: r["measured_s"])["candidate"],
        "pick_over_best": pick["measured_s"] / best, "seconds": time.perf_counter() - started,
        "goals": {"pick within 10 % of the best measured": pick["measured_s"] / best <= 1.10,
                  "every prediction within 25 % of measured": all(0.75 <= e <= 1.25 for e in errors)},
    }


def section(results: list[dict[str, Any]], command: str, date: str) -> dict[str, Any]:
    """The jobs as the ``autopilot`` section of the results (``benchmarks/schema.py``): a row per candidate, two
    goals per job."""
    fields = ("candidate", "processes", "fits", "peak_mib", "predicted_s", "predicted_rank", "measured_s",
              "predicted_over_measured")
    rows = [{"job": job_label(job), **{k: row.get(k) for k in fields}} for job in results for row in job["rows"]]
    goals = []
    for job in results:
        errors = [r["predicted_over_measured"] for r in job["rows"] if "predicted_over_measured" in r]
        goals.append(_goal(f"{job_label(job)}: measured step of the pick ({job['pick']}) / best measured "
                           f"({job['best']})", job["pick_over_best"], 1.10, "<="))
        goals.append(_goal(f"{job_label(job)}: largest |predicted / measured - 1|", max(abs(e - 1) for e in errors),
                           0.25, "<="))
    jobs = "; ".join(f"{job_label(job)}: {' '.join(job['overrides']) or 'python train.py as it is'} "
                     f"({_runs(job.get('rounds', 1))}, {job.get('date', date)}"
                     f"{'; calibrated: ' + job['calibrated'] if job.get('calibrated') else ''})" for job in results)
    return {"title": "The autopilot (layout=auto): predicted against measured",
            "setup": (f"{command}: every layout of up to the machine's cores (a job's layout.processes where it "
                      "sets them) ranked as layout=auto ranks it (step "
                      "times from blocks timed on the machine, its thread speed-up and crowding, the optimizer "
                      "step per parameter, and the step costs of each layout kind and the replicas' collectives "
                      "measured with a near-zero model), the memory plan's peak per "
                      "process; then every candidate that fits run by hand with train.py, the mean step from "
                      "the 6th on (each bucket's first left out); where a candidate ran several times, the "
                      f"candidates taking turns, the median of its runs. Jobs (each with the date it was measured): "
                      f"{jobs}. "
                      "docs/autopilot.md."),
            "rows": rows, "goals": goals}


def most_processes(job: dict[str, Any]) -> int | None:
    """The most processes a job's ranking took (its ``layout.processes`` override), ``None``: the machine's cores."""
    counts = [o.split("=", 1)[1] for o in job["overrides"] if o.startswith("layout.processes=")]
    return int(counts[-1]) if counts and counts[-1] != "auto" else None


def job_label(job: dict[str, Any]) -> str:
    """A job's name, with the most processes where the run set them (``main, up to 4 processes``)."""
    most = most_processes(job)
    return job["job"] if most is None else f"{job['job']}, up to {most} processes"


def _runs(rounds: int) -> str:
    return "one run of each candidate" if rounds == 1 else f"the median of {rounds} runs of each candidate"


def _goal(name: str, value: float, target: float, op: str) -> dict[str, Any]:
    met = value >= target if op == ">=" else value <= target
    return {"name": name, "value": float(value), "target": float(target), "op": op, "met": bool(met)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    parser.add_argument("--first", type=int, default=5, help="recorded steps left out as warm-up")
    parser.add_argument("--steps", type=int, default=30, help="steps measured after them")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each candidate, taking turns (the median)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--results", type=Path, default=None, help="add the autopilot section to these results")
    parser.add_argument("--override", action="append", default=[], help="a train.py override added to every job")
    parser.add_argument("--rank", choices=list(JOBS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        _print_ranking([*JOBS[args.rank], *args.override])
        return 0
    command = " ".join(["python benchmarks/autopilot.py",
                        *(a for a in (argv if argv is not None else sys.argv[1:]))])
    date = time.strftime("%Y-%m-%d")
    results = [{**run_job(name, [*JOBS[name], *args.override], args.first, args.steps, args.rounds), "date": date,
                "command": command} for name in args.jobs]
    out = {"command": command, "date": date, "jobs": results}
    print(json.dumps(out, indent=1))
    if args.json is not None:
        earlier = json.loads(args.json.read_text()) if args.json.exists() else None
        out = merge_jobs(earlier, out)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    if args.results is not None:
        everything = json.loads(args.results.read_text())
        everything["sections"]["autopilot"] = section(out["jobs"], out["command"], out["date"])
        args.results.write_text(json.dumps(everything, indent=1) + "\n")
    return 0 if all(all(r["goals"].values()) for r in results) else 1


def _key(job: dict[str, Any]) -> tuple[str, int | None]:
    return job["job"], most_processes(job)


def merge_jobs(earlier: dict[str, Any] | None, run: dict[str, Any]) -> dict[str, Any]:
    """``run``'s jobs in place of the same jobs of an ``earlier`` output, the others kept (each job with its date
    and command; an earlier job without them takes the earlier output's); a job is its name and its most processes
    (:func:`most_processes`); in :data:`JOBS` order, the machine's cores before a count set."""
    if earlier is None:
        return run
    jobs = {_key(job): {"date": earlier.get("date"), "command": earlier.get("command"), **job}
            for job in earlier.get("jobs", [])}
    jobs.update({_key(job): job for job in run["jobs"]})
    order = {name: i for i, name in enumerate(JOBS)}
    ordered = sorted(jobs.values(), key=lambda j: (order.get(j["job"], len(order)), most_processes(j) or 0))
    if len(ordered) == len(run["jobs"]):
        return run
    return {"command": "; ".join(sorted({j["command"] for j in ordered})), "date": max(j["date"] for j in ordered),
            "jobs": ordered}


if __name__ == "__main__":
    sys.exit(main())

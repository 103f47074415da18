"""Every benchmark of the project in one command: a JSON file of the numbers and a Markdown page generated from it.

    python benchmarks/run.py                          # full: benchmarks/results.json, docs/results.md, pictures
    python benchmarks/run.py --quick --out DIR        # CI: tiny sizes, every section, about a minute on 2 cores
    python benchmarks/run.py --render docs/results.md [--json benchmarks/results.json]   # page only, no measuring
    python benchmarks/run.py --device cuda            # on CUDA GPUs (NCCL): benchmarks/results_cuda.json and
                                                      # docs/results_cuda.md; refused when no GPU is visible
    python benchmarks/run.py --only strategy_overhead  # measure some sections again: into the existing results,
                                                      # the others kept, the page naming the later run (merged)

Sections (each a table; each goal gets a met / missed flag, a missed goal never fails the command):

* ``pipeline_bound``: pp2 step time against its own bound ``(m - 1) x max + sum`` of the stage times, GPipe and
  1F1B at several m;
* ``layouts``: tokens/s of 1 process (both cores), dp2, pp2 (even, balanced, balanced with m=auto) and pp4 on
  PTB for the ``tiny``, ``small`` and ``mxnet_ptb`` models, one global batch for all;
* ``partition_regret``: every contiguous 2-stage split against the ``balanced`` one, in the same run;
* ``bucketing``: real tokens/s and padded-token fraction of the MXNet buckets, ``auto`` and pad-to-longest;
* ``memory``: peak memory per rank (``benchmarks/memory.py``);
* ``strategy_overhead``: ``MPLSTMStrategy`` in ``Trainer.fit`` against a bare pipelining loop, pp2 and dp2 x pp2,
  GPipe and 1F1B, with each rank's time outside the schedule (``benchmarks/overhead.py``);
* ``advice``: ``lightning_mp_lstm.planning.advice``'s predicted order of layouts against the measured one;
* ``wavefront``: one process, GPipe (the batch split in m microbatches), the wavefront (the time axis split in k
  chunks) and rows x chunks on one model and global batch, each against its own bound, with every rank's peak
  memory (docs/wavefront.md).

With ``--device cuda`` every rank trains on its own GPU (one process per GPU, NCCL) and peak memory is the GPU's
(``torch.cuda.max_memory_allocated``) instead of the host's RSS; ``advice`` and ``strategy_overhead`` are CPU-only
(:data:`CPU_ONLY`) and left out. The command refuses, before measuring anything, when CUDA is not available or
fewer GPUs are visible than its layouts have processes.

Times are medians over steps after warm-up (tokens/s: real tokens over the timed steps); ratios compare runs made
in the same invocation; every rank runs one thread unless its row says otherwise. The script checks its JSON
against its schema (``benchmarks/schema.py``) and exits with status 2 when it does not hold, 1 on an error.

This file is the command line and the order of the runs; the rest lives beside it: ``sizes.py`` (how big, how long),
``specs.py`` (the jobs of each section), ``jobs.py`` (what the ranks run), ``sections.py`` (results to tables),
``schema.py`` (the JSON's schema), ``render.py`` (the page) and ``earlier.json`` (hand-measured older numbers).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import jobs, sections, specs  # noqa: E402
from benchmarks.common import ROOT, stored_path  # noqa: E402
from benchmarks.render import write_page  # noqa: E402
from benchmarks.schema import SCHEMA, SECTIONS, SchemaError, validate  # noqa: E402
from benchmarks.sizes import FULL, QUICK, Sizes  # noqa: E402

DEFAULT_JSON = ROOT / "benchmarks" / "results.json"
DEFAULT_PAGE = ROOT / "docs" / "results.md"
DEFAULT_PICTURES = ROOT / "docs" / "_static" / "results"
#: Where ``--device cuda`` writes by default (the CPU results stay where they are).
CUDA_JSON = ROOT / "benchmarks" / "results_cuda.json"
CUDA_PAGE = ROOT / "docs" / "results_cuda.md"
CUDA_PICTURES = ROOT / "docs" / "_static" / "results" / "cuda"
#: Sections that measure the CPU only, and why; ``--device cuda`` leaves them out.
CPU_ONLY = {
    "advice": "lightning_mp_lstm.planning.advice calibrates CPU threads and a host memory copy, and refuses GPUs",
    "strategy_overhead": "its bare loop is a CPU pipeline on gloo",
}


def machine(device: str = "cpu") -> dict[str, Any]:
    """The CPU, its cores, the versions and the load (1, 5, 15 minutes) right now; on ``cuda`` the GPUs too."""
    import lightning
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {"cpu": cpu, "cores": os.cpu_count() or 1, "torch": torch.__version__, "lightning": lightning.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "load_before": list(os.getloadavg()),
            "device": device}
    if device == "cuda":
        info.update(gpu=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count(), cuda=torch.version.cuda)
    return info


def processes_needed(sizes: Sizes, only: Sequence[str]) -> int:
    """The most processes the jobs of sections ``only`` run at once (on CUDA: GPUs, one per process)."""
    worlds = [1]
    if "pipeline_bound" in only:
        worlds.append(4)  # the dp2 x pp2 picture
    if "partition_regret" in only:
        worlds.append(2)
    if "layouts" in only or "advice" in only:
        worlds += [world for world, todo in specs.layout_jobs(sizes, 0).items() if todo]
    if "memory" in only:
        worlds += list(sizes.memory_layouts.values())
    if "wavefront" in only:
        worlds += [world for world, _ in specs.wavefront_jobs(sizes, None)]
    return max(worlds)


def cuda_problem(sizes: Sizes, only: Sequence[str]) -> str | None:
    """Why ``--device cuda`` cannot run sections ``only`` here (``None``: it can)."""
    import torch

    if not torch.cuda.is_available():
        return (f"CUDA is not available (torch {torch.__version__}, built for CUDA {torch.version.cuda}): run it on "
                "a machine with NVIDIA GPUs and a CUDA build of torch, or leave out --device cuda for the CPU rows")
    needed, visible = processes_needed(sizes, only), torch.cuda.device_count()
    if visible < needed:
        return (f"the sections {', '.join(only)} run up to {needed} processes, one per GPU, and {visible} GPU(s) "
                "are visible; pick sections that fit with --only (bucketing: 1 GPU, partition_regret: 2)")
    return None


def _run(fixed: dict[int, list[dict[str, Any]]], sizes: Sizes, need_layouts: bool, log: Callable[[str], None],
         device: str = "cpu") -> tuple[list[tuple[dict[str, Any], Any]], dict[str, list[Any]]]:
    """Run the ``fixed`` jobs (by number of processes) and, when needed, every round of the layouts.

    Returns:
        Every job with its result (:func:`benchmarks.jobs.merge`), and every rank's result of the memory jobs by
        layout.
    """
    done: list[tuple[dict[str, Any], Any]] = []
    memory_ranks: dict[str, list[Any]] = {}
    rounds = sizes.layout_rounds if need_layouts else 1
    for r in range(rounds):
        layout_jobs = specs.layout_jobs(sizes, r) if need_layouts else {1: [], 2: [], 4: []}
        for world in (1, 2, 4):
            todo = [{**job, "device": device} for job in (fixed[world] if r == 0 else []) + layout_jobs[world]]
            if not todo:
                continue
            log(f"  round {r + 1}/{rounds}: {len(todo)} runs on {world} process(es) ...")
            started = time.perf_counter()
            ranks = jobs.spawn(world, todo, sizes.timeout, sizes.start_method)
            spent: dict[str, float] = {}
            for i, job in enumerate(todo):
                per_rank = [on_rank[i][0] for on_rank in ranks]
                done.append((job, jobs.merge(job, per_rank)))
                if job["kind"] == "memory":
                    memory_ranks[job["layout"]] = per_rank
                spent[job["section"]] = spent.get(job["section"], 0.0) + ranks[0][i][1]
            log(f"    {time.perf_counter() - started:.0f} s ({', '.join(f'{k} {v:.0f} s' for k, v in spent.items())})")
    return done, memory_ranks


def measure(sizes: Sizes, pictures: Path, only: Sequence[str] = SECTIONS, log: Callable[[str], None] = print,
            device: str = "cpu") -> dict[str, Any]:
    """Run the benchmarks of some sections.

    Args:
        sizes: how big and how long (:data:`benchmarks.sizes.FULL` or :data:`~benchmarks.sizes.QUICK`).
        pictures: the directory for the timeline pictures.
        only: the sections to measure.
        log: where progress lines go.
        device: ``"cpu"`` (gloo) or ``"cuda"`` (one GPU per process, NCCL; :func:`cuda_problem` first).

    Returns:
        ``{"sections": ..., "pictures": ...}`` of the results JSON.
    """
    pictures.mkdir(parents=True, exist_ok=True)
    need_layouts = "layouts" in only or "advice" in only
    pp2_png, dp2_pp2_png = pictures / "timeline_pp2.png", pictures / "timeline_dp2_pp2.png"
    wave_png = pictures / "timeline_wavefront_pp2.png"
    fixed: dict[int, list[dict[str, Any]]] = {1: [], 2: [], 4: []}
    if "strategy_overhead" in only:
        for world, job in specs.overhead_jobs(sizes):
            fixed[world].append(job)
    if "pipeline_bound" in only:
        for stale in (pp2_png, dp2_pp2_png):  # only this run's pictures may be listed
            stale.unlink(missing_ok=True)
        fixed[2] += specs.bound_jobs(sizes, pp2_png, bare=device == "cpu")  # the bare loop is a CPU one
        fixed[4].append(specs.dp2_pp2_job(sizes, dp2_pp2_png))
    if "partition_regret" in only:
        fixed[2] += specs.regret_jobs(sizes)
    if "advice" in only:
        fixed[1] += specs.advice_jobs(sizes)
    if "bucketing" in only:
        fixed[1] += specs.bucket_jobs(sizes)
    inline_memory = "memory" in only and sizes.memory_inline
    if inline_memory:
        for world, job in specs.memory_jobs(sizes):
            fixed[world].insert(0, job)  # a process's peak memory never goes down: first in fresh processes
    fresh: list[tuple[dict[str, Any], Any]] = []
    if "wavefront" in only:
        wave_png.unlink(missing_ok=True)
        todo = [(world, {**job, "device": device}) for world, job in specs.wavefront_jobs(sizes, wave_png)]
        if sizes.wave_fresh:  # each in fresh processes: a process's peak memory is then the run's own
            log(f"  wavefront: {len(todo)} runs, each in fresh processes ...")
            started = time.perf_counter()
            for world, job in todo:
                ranks = jobs.spawn(world, [job], sizes.timeout, sizes.start_method)
                fresh.append((job, jobs.merge(job, [on_rank[0][0] for on_rank in ranks])))
            log(f"    {time.perf_counter() - started:.0f} s")
        else:
            for world, job in todo:
                fixed[world].append(job)
    done, memory_ranks = _run(fixed, sizes, need_layouts, log, device)
    done += fresh

    def of(section: str) -> list[tuple[dict, Any]]:
        return [(job, result) for job, result in done if job.get("section") == section]

    found: dict[str, Any] = {}
    if "pipeline_bound" in only:
        found["pipeline_bound"] = sections.section_bound(of("pipeline_bound"), sizes)
    if need_layouts:
        layouts = sections.section_layouts(of("layouts"), sizes)
        if "layouts" in only:
            found["layouts"] = layouts
        if "advice" in only:
            found["advice"] = sections.section_advice(of("advice"), layouts)
    if "partition_regret" in only:
        found["partition_regret"] = sections.section_regret(of("partition_regret"), sizes)
    if "bucketing" in only:
        found["bucketing"] = sections.section_bucketing(of("bucketing"), sizes)
    if "strategy_overhead" in only:
        found["strategy_overhead"] = sections.section_overhead(of("strategy_overhead"), sizes)
    if "memory" in only:
        if not inline_memory:
            log("  memory (benchmarks/memory.py) ...")
            started = time.perf_counter()
            from benchmarks import memory

            memory_ranks = memory.measure(sizes.memory_hidden, sizes.memory_rows, sizes.memory_steps,
                                          sizes.memory_layouts, sizes.memory_formats, timeout=sizes.timeout,
                                          device=device)
            log(f"    {time.perf_counter() - started:.0f} s")
        else:
            memory_ranks = {layout: [{**r, "file": r} for r in ranks] for layout, ranks in memory_ranks.items()}
        found["memory"] = sections.section_memory(memory_ranks, sizes)
    if "wavefront" in only:
        found["wavefront"] = sections.section_wavefront(of("wavefront"), sizes)
    pictures_written = {}
    for name, path, section in (("pp2", pp2_png, "pipeline_bound"), ("dp2_pp2", dp2_pp2_png, "pipeline_bound"),
                                ("wavefront_pp2", wave_png, "wavefront")):
        if section in only and path.is_file():
            pictures_written[name] = stored_path(path)
    return {"sections": {k: found[k] for k in SECTIONS if k in found}, "pictures": pictures_written}


def merged(earlier: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    """The results of a run of some sections put into the ``earlier`` results of the same file: its sections
    replaced, the others kept, and the run listed under ``updates`` (which sections, its command, date, duration and
    load), so that a partial run never loses what the full run measured and the page says what came from where."""
    if earlier.get("mode") != run["mode"] or earlier.get("schema") != run["schema"]:
        return run
    update = {"sections": sorted(run["sections"]), "command": run["command"], "date": run["date"],
              "duration_s": run["duration_s"], "load_before": run["machine"]["load_before"],
              "load_after": run["machine"]["load_after"]}
    kept = [u for u in earlier.get("updates", []) if set(u["sections"]) - set(run["sections"])]
    return {**earlier, "sections": {**earlier["sections"], **run["sections"]}, "updates": [*kept, update]}


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module's docstring).

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, or 2 when the results do not hold the schema.
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few steps (CI)")
    parser.add_argument("--out", type=Path, default=None,
                        help="directory for results.json, results.md and the pictures (default: benchmarks/"
                             "results.json, docs/results.md, docs/_static/results/; with --quick a new temporary "
                             "directory)")
    parser.add_argument("--render", type=Path, default=None, metavar="PAGE",
                        help="only write the Markdown page PAGE from --json, measuring nothing")
    parser.add_argument("--json", type=Path, default=None, help="results to render (default benchmarks/results.json)")
    parser.add_argument("--only", default=None,
                        help=f"comma-separated sections to measure (default all: {','.join(SECTIONS)}; with "
                             f"--device cuda all but the CPU-only {','.join(CPU_ONLY)})")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu (gloo, the default) or cuda (one GPU per process, NCCL; default output "
                             "benchmarks/results_cuda.json and docs/results_cuda.md)")
    args = parser.parse_args(argv)
    if args.render is not None:
        source = args.json or DEFAULT_JSON
        results = json.loads(source.read_text())
        try:
            validate(results, [s for s in SECTIONS if s in results.get("sections", {})])
        except SchemaError as error:
            print(f"{source}: {error}", file=sys.stderr)
            return 2
        write_page(results, args.render)
        print(f"wrote {args.render}")
        return 0
    cuda = args.device == "cuda"
    default_only = [s for s in SECTIONS if not (cuda and s in CPU_ONLY)]
    only = [s.strip() for s in args.only.split(",") if s.strip()] if args.only is not None else default_only
    unknown = set(only) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; known: {', '.join(SECTIONS)}")
    if cuda:
        cpu_only = [s for s in only if s in CPU_ONLY]
        if cpu_only:
            parser.error("--device cuda: " + "; ".join(f"{s} is CPU-only ({CPU_ONLY[s]})" for s in cpu_only))
        problem = cuda_problem(QUICK if args.quick else FULL, only)
        if problem is not None:
            print(f"benchmarks/run.py --device cuda refused: {problem}", file=sys.stderr)
            return 2
    out = args.out
    if out is None and args.quick:
        out = Path(tempfile.mkdtemp(prefix="mp_lstm_benchmarks_"))
    defaults = (CUDA_JSON, CUDA_PAGE, CUDA_PICTURES) if cuda else (DEFAULT_JSON, DEFAULT_PAGE, DEFAULT_PICTURES)
    json_path, page = (out / "results.json", out / "results.md") if out else defaults[:2]
    pictures = out if out else defaults[2]
    sizes = QUICK if args.quick else FULL
    command = "python benchmarks/run.py" + (" --quick" if args.quick else "") + (" --device cuda" if cuda else "") + (
        f" --only {','.join(only)}" if set(only) != set(default_only) else "")
    started = time.perf_counter()
    info = machine(args.device)
    gpus = f", {info['gpus']} x {info['gpu']}" if cuda else ""
    print(f"{command}: {info['cpu']}, {info['cores']} cores{gpus}, load {info['load_before'][0]:.2f}", flush=True)
    measured = measure(sizes, pictures, only, log=lambda line: print(line, flush=True), device=args.device)
    info["load_after"] = list(os.getloadavg())
    results = {"schema": SCHEMA, "mode": "quick" if args.quick else "full", "command": command,
               "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
               "duration_s": time.perf_counter() - started, "machine": info, **measured}
    if set(only) != set(default_only) and json_path.exists():
        results = merged(json.loads(json_path.read_text()), results)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=1) + "\n")
    try:
        validate(results, only)
    except SchemaError as error:
        print(f"{json_path}: {error}", file=sys.stderr)
        return 2
    write_page(results, page)
    for section in results["sections"].values():
        for goal in section["goals"]:
            print(f"  {'met   ' if goal['met'] else 'MISSED'} {goal['name']}: {goal['value']:.3f} "
                  f"(goal {goal['op']} {goal['target']:g})")
    print(f"wrote {json_path} and {page} in {results['duration_s']:.0f} s; load average now "
          f"{info['load_after'][0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

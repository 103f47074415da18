"""The Markdown page of a benchmark run (``docs/results.md``), generated from its results JSON alone."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import ROOT, resolve_stored
from benchmarks.schema import OPTIONAL_SECTIONS, SECTIONS


def _num(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        return f"{value:.{digits}g}" if abs(value) < 1 else f"{value:.{digits}f}".rstrip("0").rstrip(".")
    if isinstance(value, list):
        return ", ".join(_num(v, digits) for v in value)
    return str(value).replace("|", "\\|")


def _whole(value: Any) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ms(values: Any) -> str:
    if isinstance(values, list):
        return ", ".join(f"{v * 1e3:.1f}" for v in values)
    return f"{values * 1e3:.1f}"


def _fixed_digits(digits: int) -> Callable[[Any], str]:
    return lambda v: f"{v:.{digits}f}"


def _percent(value: Any) -> str:
    return f"{value:.1%}"


def _mib(value: Any) -> str:
    return "-" if value is None else f"{value:.0f}"


def _col(header: str, key: str, fmt: Callable[[Any], str] = _num) -> tuple[str, Callable[[dict[str, Any]], str]]:
    return header, lambda row: fmt(row.get(key))


#: Columns of each section's table: (header, cell of a row).
COLUMNS: dict[str, list[tuple[str, Callable[[dict[str, Any]], str]]]] = {
    "pipeline_bound": [
        _col("schedule", "schedule"), _col("m", "m"), _col("rows per microbatch", "rows_per_microbatch"),
        _col("stage ms (in the pipeline)", "stage_s", _ms), _col("bound ms", "bound_s", _ms),
        _col("measured step ms", "measured_s", _ms), _col("**bound / measured**", "ratio", _fixed_digits(3)),
        _col("recorded step ms", "recorded_s", _ms),
        _col("compute ends ms", "compute_end_s", _ms), _col("bound / compute end", "schedule_ratio", _fixed_digits(3)),
        _col("bare loop step ms", "bare_step_s", lambda v: "-" if v is None else _ms(v)),
        _col("bound / bare loop step", "bare_ratio", lambda v: "-" if v is None else f"{v:.3f}"),
        _col("stage ms (isolated)", "isolated_stage_s", _ms),
        _col("isolated bound / measured", "isolated_ratio", _fixed_digits(3)),
        _col("bubble measured", "bubble_measured", _percent), _col("bubble predicted", "bubble_predicted", _percent)],
    "layouts": [
        _col("model", "model"), _col("layout", "layout"),
        ("processes x threads", lambda row: f"{row['processes']} x {row['threads']}"), _col("m", "m"),
        _col("partition", "partition"), _col("tokens/s", "tokens_per_s", _whole),
        _col("**x 1 process**", "ratio", _fixed_digits(2)), _col("s/step", "step_s", _fixed_digits(3)),
        _col("earlier tokens/s", "earlier_tokens_per_s", _whole)],
    "partition_regret": [
        _col("setting", "setting"), _col("split", "split"), _col("step s", "step_s", _fixed_digits(3)),
        _col("**x best split**", "ratio_to_best", _fixed_digits(3)), _col("stage ms (isolated)", "stage_s", _ms),
        _col("max / mean", "max_over_mean", _fixed_digits(3))],
    "bucketing": [
        _col("buckets", "buckets"), _col("lengths", "lengths"), _col("padded (split)", "padded_fraction", _percent),
        _col("padded (timed batches)", "batch_padded_fraction", _percent),
        _col("real tokens/s", "real_tokens_per_s", _whole), _col("**x pad to longest**", "speedup", _fixed_digits(2))],
    "memory": [
        _col("layout", "layout"), _col("rank", "rank"), _col("blocks", "blocks"), _col("parameters", "params"),
        _col("floor MiB", "floor_mib", _mib), _col("training MiB", "training_mib", _mib),
        _col("predicted MiB", "predicted_mib", _mib), _col("after one-file save", "file_save_mib", _mib),
        _col("after sharded save", "sharded_save_mib", _mib),
        _col("**training / 1 process**", "ratio", _fixed_digits(2))],
    "strategy_overhead": [
        _col("layout", "layout"), _col("schedule", "schedule"), _col("bare tokens/s", "bare_tokens_per_s", _whole),
        _col("mp_lstm tokens/s", "strategy_tokens_per_s", _whole),
        _col("**mp_lstm / bare** (median of rounds)", "ratio", _fixed_digits(3)), _col("each round", "round_ratios"),
        _col("pooled", "pooled_ratio", _fixed_digits(3)),
        _col("outside the schedule per rank, ms: bare / mp_lstm (before + after)", "outside_ms"),
        _col("timed steps", "timed_steps")],
    "advice": [
        _col("model", "model"), _col("candidate", "candidate"), _col("measured as", "layout"),
        _col("predicted s/step", "predicted_s", _fixed_digits(3)), _col("predicted rank", "predicted_rank"),
        _col("measured s/step", "measured_s", _fixed_digits(3)), _col("measured rank", "measured_rank"),
        _col("predicted / measured", "predicted_over_measured", lambda v: "-" if v is None else f"{v:.2f}"),
        _col("tokens/s", "tokens_per_s", _whole)],
    "autopilot": [
        _col("job", "job"), _col("candidate", "candidate"), _col("processes", "processes"),
        _col("fits", "fits", lambda v: "yes" if v else "**no**"),
        _col("peak MiB", "peak_mib", lambda v: "-" if v is None else f"{v:,.0f}"),
        _col("predicted s/step", "predicted_s", _fixed_digits(4)), _col("predicted rank", "predicted_rank"),
        _col("measured s/step", "measured_s", lambda v: "-" if v is None else f"{v:.4f}"),
        _col("**predicted / measured**", "predicted_over_measured", lambda v: "-" if v is None else f"{v:.2f}")],
    "wikitext103": [
        _col("run", "run"), _col("command", "command", lambda c: f"`{c}`"), _col("exit", "exit"),
        _col("seconds", "seconds", _whole),
        _col("peak anonymous MiB per process", "anon_mib", lambda v: ", ".join(f"{x:,.0f}" for x in v)),
        _col("VmHWM MiB per process", "hwm_mib", lambda v: ", ".join(f"{x:,.0f}" for x in v)),
        _col("memory plan's peak MiB", "predicted_mib", lambda v: ", ".join(f"{x:,.0f}" for x in v) if v else "-"),
        _col("s/step", "step_s", lambda v: "-" if v is None else f"{v:.2f}")],
    "wavefront": [
        _col("run", "variant"), _col("processes", "processes"), _col("m x k", "units", str),
        _col("step ms", "step_s", _ms), _col("tokens/s", "tokens_per_s", _whole),
        _col("**x 1 process**", "x_one_process", _fixed_digits(2)),
        _col("bound ms", "bound_s", lambda v: "-" if v is None else _ms(v)),
        _col("**bound / measured**", "ratio", lambda v: "-" if v is None else f"{v:.3f}"),
        _col("bubble measured", "bubble_measured", lambda v: "-" if v is None else _percent(v)),
        _col("bubble predicted", "bubble_predicted", lambda v: "-" if v is None else _percent(v)),
        _col("peak MiB per rank", "peak_mib", lambda v: ", ".join(f"{x:.0f}" for x in v)),
        _col("**peak / GPipe**", "peak_over_gpipe", lambda v: "-" if v is None else f"{v:.3f}")],
}


def _table(section: str, rows: Sequence[dict[str, Any]]) -> list[str]:
    columns = COLUMNS[section]
    lines = ["| " + " | ".join(header for header, _ in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(row) for _, cell in columns) + " |" for row in rows]
    return lines


def _goal_lines(goals: Sequence[dict[str, Any]]) -> list[str]:
    return [f"- {g['name']}: **{g['value']:.3f}** (goal {g['op']} {g['target']:g}) — "
            f"{'met' if g['met'] else '**missed**'}" for g in goals]


def _note(section: str, rows: Sequence[dict[str, Any]]) -> str:
    """What a section's numbers say beyond its goals (empty when nothing)."""
    if section == "partition_regret":
        balanced = next(r for r in rows if r["setting"] == "balanced")
        splits = [r for r in rows if r["setting"] != "balanced"]
        fastest = min(splits, key=lambda r: r["step_s"])
        evenest = min(splits, key=lambda r: r["max_over_mean"])
        chose = (f"partition='balanced' chose the split that ran fastest ({fastest['split']}), so the step ratio "
                 "compares two runs of the same split (run-to-run noise)" if fastest["split"] == balanced["split"]
                 else f"partition='balanced' chose {balanced['split']}, the fastest run was {fastest['split']}")
        return (f"{chose}. The most even contiguous split measured max / mean {evenest['max_over_mean']:.3f} "
                f"({evenest['split']}) in its own run: whole blocks set how even a split can be.")
    if section == "bucketing":
        within = [r for r in rows if r["padded_fraction"] <= 0.10 and not r["buckets"].startswith("none")]
        if within:
            r = within[0]
            return (f"{r['buckets']} pads {r['padded_fraction']:.1%} of the tokens and runs {r['speedup']:.2f}x "
                    "pad-to-longest: on PTB's sentence lengths the 10 % padding goal needs more buckets than 5.")
    return ""


def _pays(results: dict[str, Any]) -> list[str]:
    """The 'When does pipelining pay' text, its numbers from ``results``."""
    sections = results["sections"]
    lines = ["## When does pipelining pay", ""]
    layouts = sections.get("layouts", {}).get("rows", [])
    facts, slower = [], []
    for model in dict.fromkeys(r["model"] for r in layouts):
        rows = {r["layout"]: r for r in layouts if r["model"] == model}
        pipes = [r for k, r in rows.items() if k.startswith("pp2")]
        if "1 process" in rows and pipes:
            best = max(pipes, key=lambda r: r["tokens_per_s"])
            factor = rows["1 process"]["tokens_per_s"] / best["tokens_per_s"]
            slower.append(factor)
            facts.append(f"{model} {factor:.2f}x the tokens/s of its fastest 2-stage pipeline ({best['layout']})")
    if facts:
        verdict = ("beat the fastest 2-stage pipeline with one thread per rank for every model" if min(slower) > 1
                   else "did not beat the fastest 2-stage pipeline for every model")
        lines.append(f"On this machine ({results['machine']['cores']} cores) one process using both cores {verdict}: "
                     f"{'; '.join(facts)}.")
    bound = sections.get("pipeline_bound", {}).get("rows", [])
    if bound:
        ratios = [r["ratio"] for r in bound]
        schedule = [r["schedule_ratio"] for r in bound]
        if min(ratios) >= 0.95:
            verdict = "The pipeline reaches its own bound at every setting"
        else:
            verdict = (f"The pipeline stays up to {1 - min(ratios):.0%} away from its own bound (goal: within 5 %)"
                       if min(ratios) >= 0.5 else "At these sizes the pipeline is far from its own bound: fixed "
                       "costs per step and per microbatch (communication, Python, Lightning) outweigh the compute")
        bare = [r["bare_ratio"] for r in bound if r.get("bare_ratio") is not None]
        floor = (f" A hand-written torch.distributed.pipelining loop (no Lightning, no clipping) on the same sizes "
                 f"reaches {min(bare):.2f} to {max(bare):.2f} of the same bound." if bare else "")
        lines += ["", f"{verdict}. The bound, (m - 1) x max + sum of the stage times measured inside the same "
                  f"run, is {min(ratios):.2f} to {max(ratios):.2f} of the measured step; up to the end of the "
                  f"schedule's last backward it is {min(schedule):.2f} to {max(schedule):.2f}, and the rest of a step "
                  f"is the optimizer, the global-norm clipping across stages and Lightning's loop.{floor} What a "
                  "pipeline cannot do on one CPU is make the cores faster: two single-thread processes share the two "
                  "cores that one two-thread process uses, wait for each other in the fill and the drain, pass "
                  "activations and gradients through memory, and multiply matrices m times smaller than one process "
                  "running the whole batch."]
    memory = sections.get("memory", {}).get("rows", [])
    pp = [r for r in memory if r["layout"].startswith("pp")]
    if pp:
        deepest = max({r["layout"] for r in pp}, key=lambda name: int(name[2:]))
        largest = max(r["ratio"] for r in pp if r["layout"] == deepest)
        lines += ["", f"What a pipeline does buy is memory per process: the largest {deepest} rank peaked at "
                  f"{largest:.2f}x the one-process peak (the memory section's model)."]
    lines += ["", "Pipelining pays when the model does not fit one device's memory (each stage holds only its share "
              "of the parameters, gradients and optimizer state), and when the devices are really separate (GPUs, or "
              "machines), so that the stages compute at the same time instead of taking turns on the same cores. On "
              "one multi-core CPU with a model that fits, one process with all the cores is the layout to beat."]
    return lines


def _gpu_rows(results: dict[str, Any]) -> list[str]:
    """Where the GPU rows are: this page's (a ``--device cuda`` run), or the command that produces them."""
    m = results["machine"]
    lines = ["## GPU rows", ""]
    if m.get("device") == "cuda":
        return lines + [f"Every row of this page is CUDA: {m['gpus']} x {m['gpu']} (CUDA {m['cuda']}), one process "
                        "per GPU on NCCL; the memory section's peaks are the GPUs' "
                        "(`torch.cuda.max_memory_allocated`), not the host's. The CPU-only sections (advice, strategy "
                        "overhead) are left out."]
    return lines + ["Not measured yet: no GPU was available for this run, and every row above is CPU (gloo). The GPU "
                    "rows are produced by `python benchmarks/run.py --device cuda` on a machine with CUDA GPUs (one "
                    "process per GPU, NCCL; peak memory from `torch.cuda.max_memory_allocated`), which writes "
                    "`benchmarks/results_cuda.json` and its page `docs/results_cuda.md`. [GPU status](gpu.md) says "
                    "how to run it and report the output."]


#: The timeline pictures the page shows under each section, and their captions.
PICTURES = {"pipeline_bound": (("pp2", "A recorded pp2 step (1F1B)"),
                               ("dp2_pp2", "A recorded dp2 x pp2 step, both replicas (1F1B, 4 processes on 2 cores)")),
            "wavefront": (("wavefront_pp2", "A recorded pp2 wavefront step: time chunks (unit numbers) run "
                                            "diagonally, backward in reverse"),)}


def render(results: dict[str, Any], page: Path | None = None) -> str:
    """The Markdown page of ``results``.

    Args:
        results: valid results (:func:`benchmarks.schema.validate`).
        page: where the page will be; picture links are made relative to its directory (default: the
            repository root).

    Returns:
        The page's text.
    """
    m = results["machine"]
    base = page.resolve().parent if page is not None else ROOT
    lines = ["# Results", "",
             f"Every number on this page comes from one run of `{results['command']}` "
             f"({results['mode']} mode, {results['date']}, {results['duration_s'] / 60:.1f} minutes); the page is "
             "generated from that run's JSON (`python benchmarks/run.py --render docs/results.md` rewrites it from "
             "`benchmarks/results.json` without measuring). See [Benchmarks](benchmarks.md) for the individual "
             "scripts and earlier findings. The machine was shared: the load averages below say how busy it was.",
             *_updates(results),
             "",
             "| machine | |", "| --- | --- |",
             f"| CPU | {m['cpu']} |", f"| cores | {m['cores']} |", f"| torch | {m['torch']} |",
             f"| Lightning | {m['lightning']} |", f"| Python | {m['python']} |",
             *([f"| GPUs | {m['gpus']} x {m['gpu']} (CUDA {m['cuda']}) |"] if m.get("device") == "cuda" else []),
             f"| load average (1, 5, 15 min) before | {', '.join(f'{v:.2f}' for v in m['load_before'])} |",
             f"| load average after | {', '.join(f'{v:.2f}' for v in m['load_after'])} |", "",
             "Goals met: " + ", ".join(f"{sum(g['met'] for g in s['goals'])} of {len(s['goals'])} ({s['title']})"
                                       for s in results["sections"].values() if s["goals"]) + ".", ""]
    pictures = results.get("pictures", {})
    for name in (*SECTIONS, *OPTIONAL_SECTIONS):
        section = results["sections"].get(name)
        if section is None:
            continue
        lines += [f"## {section['title']}", "", section["setup"], ""]
        lines += _table(name, section["rows"])
        lines.append("")
        if section["goals"]:
            lines += _goal_lines(section["goals"]) + [""]
        note = _note(name, section["rows"])
        if note:
            lines += [note, ""]
        for key, caption in PICTURES.get(name, ()):
            if key in pictures:
                relative = os.path.relpath(resolve_stored(pictures[key]), base)
                lines += [f"![{caption}]({Path(relative).as_posix()})", "", f"*{caption}.*", ""]
    lines += _pays(results)
    lines += [""] + _gpu_rows(results)
    return "\n".join(lines).rstrip() + "\n"


def _updates(results: dict[str, Any]) -> list[str]:
    """The page's lines for the sections measured again after the full run (``benchmarks/run.py --only``)."""
    lines = []
    for update in results.get("updates", []):
        titles = ", ".join(results["sections"][name]["title"] for name in update["sections"]
                           if name in results["sections"])
        load = f"load average {update['load_before'][0]:.2f} before, {update['load_after'][0]:.2f} after"
        lines += ["", f"The numbers of {titles} come from a later run instead: `{update['command']}` "
                      f"({update['date']}, {update['duration_s'] / 60:.1f} minutes, {load})."]
    return lines


def write_page(results: dict[str, Any], page: Path) -> None:
    """Write :func:`render`'s page of ``results`` to ``page`` (creating its directory)."""
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(render(results, page))

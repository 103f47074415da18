"""The benchmark suite: ``benchmarks/run.py --quick`` measures every section under a deadline, writes a JSON file that
holds its schema with real values and a Markdown page; the page renders again from the JSON alone, and broken
results are refused."""

from __future__ import annotations

import copy
import json
import math
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from benchmarks import main_job, replica_sums, run, sections
from benchmarks.schema import SCHEMA, SECTIONS, SchemaError, validate
from benchmarks.sizes import LAYOUTS, QUICK
from tests.helpers import ROOT, run_command, run_ranks

SCRIPT = ROOT / "benchmarks" / "run.py"


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One ``--quick`` run for the whole module: its directory, JSON, page and output."""
    out = tmp_path_factory.mktemp("benchmarks")
    result = run_command([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], timeout=280)
    assert result.returncode == 0, result.stdout[-6000:]
    return {"out": out, "results": json.loads((out / "results.json").read_text()),
            "page": (out / "results.md").read_text(), "stdout": result.stdout}


def _finite_positive(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_quick_run_measures_every_section_and_holds_the_schema(quick):
    results = quick["results"]
    assert results["mode"] == "quick" and results["schema"] == SCHEMA
    assert list(results["sections"]) == list(SECTIONS)
    validate(results)
    machine = results["machine"]
    assert machine["cores"] >= 1 and machine["torch"] and machine["lightning"] and len(machine["load_after"]) == 3
    assert 0 < results["duration_s"] < 280
    for section in results["sections"].values():
        for goal in section["goals"]:
            expected = goal["value"] >= goal["target"] if goal["op"] == ">=" else goal["value"] <= goal["target"]
            assert goal["met"] is expected, goal
            assert f"{goal['name']}: {goal['value']:.3f}" in quick["stdout"]  # every goal is printed with its value


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_pipeline_bound_rows_are_measured(quick):
    section = quick["results"]["sections"]["pipeline_bound"]
    rows = section["rows"]
    assert {(r["schedule"], r["m"]) for r in rows} == {(s, m) for s in ("GPipe", "1F1B") for m in QUICK.bound_m}
    for row in rows:
        assert len(row["stage_s"]) == len(row["isolated_stage_s"]) == 2
        assert all(_finite_positive(t) for t in row["stage_s"] + row["isolated_stage_s"])
        # The bound is computed from the stage times: (m - 1) x max + sum, here for the medians of the steps.
        assert row["bound_s"] > (row["m"] - 1) * min(row["stage_s"])
        assert math.isclose(row["isolated_bound_s"],
                            (row["m"] - 1) * max(row["isolated_stage_s"]) + sum(row["isolated_stage_s"]))
        assert _finite_positive(row["ratio"]) and _finite_positive(row["measured_s"])
        # The schedule's compute ends inside its own recorded step (a timed ratio against another step flaked here).
        assert row["compute_end_s"] <= row["recorded_s"]
        assert 0 < row["bubble_predicted"] < 1
        # The hand-written loop ran beside it (CPU) and is held against the same bound.
        assert _finite_positive(row["bare_step_s"]) and _finite_positive(row["recorded_s"])
        assert row["bare_ratio"] == pytest.approx(row["bound_s"] / row["bare_step_s"])
    assert len(section["goals"]) == len(rows)


def _span(rank: int, kind: str, microbatch: int, start: float, end: float) -> dict[str, Any]:
    return {"rank": rank, "stage": rank, "kind": kind, "microbatch": microbatch, "start": start, "end": end,
            "direction": "", "peer_stage": None}


def test_the_bound_is_held_against_the_step_after_each_recorded_one():
    """The measured step is the unrecorded step after each recorded one (the recording's barrier and gathering of
    spans are not the pipeline's); the recorded steps' own interval is shown apart, and the bare loop's median step
    after the warm-up is held against the same bound. The last stage's loss counts as its work."""
    m = 2
    spans = [_span(0, "forward", 0, 0.0, 0.01), _span(0, "forward", 1, 0.01, 0.02),
             _span(1, "forward", 0, 0.01, 0.02), _span(1, "loss", 0, 0.02, 0.03),
             _span(1, "forward", 1, 0.03, 0.04), _span(1, "loss", 1, 0.04, 0.05),
             _span(1, "backward", 0, 0.05, 0.06), _span(1, "backward", 1, 0.06, 0.07),
             _span(0, "backward", 0, 0.06, 0.07), _span(0, "backward", 1, 0.07, 0.08)]
    first = QUICK.bound_warmup + 1
    recorded = [first, first + 2]
    records = [{"step": step, "wall": 0.09, "spans": spans, "tokens": 100, "num_stages": 2, "n_microbatches": m,
                "schedule": "GPipe", "stage_ranks": {0: 0, 1: 1}, "rank_walls": {0: 0.09, 1: 0.09}}
               for step in recorded]
    # Recorded steps last 0.12 s, the others 0.10 s.
    starts, t = [], 0.0
    for step in range(first + 5):
        starts.append(t)
        t += 0.12 if step in recorded else 0.10
    result = {"m": m, "records": records, "starts": starts, "ends": [s + 0.09 for s in starts],
              "stage_seconds": [0.02, 0.04]}
    bare = {"intervals": [0.5] * first + [0.08, 0.09, 0.07], "schedule": []}
    section = sections.section_bound([({"kind": "fit", "schedule": "GPipe"}, result),
                                      ({"kind": "bare", "schedule": "GPipe", "m": m}, bare)], QUICK)
    (row,) = section["rows"]
    # Stage 0: two forwards and two backwards of 0.01 s over m; stage 1 with its two losses: 0.06 s over m.
    assert row["stage_s"] == pytest.approx([0.02, 0.03])
    assert row["bound_s"] == pytest.approx((m - 1) * 0.03 + 0.05)
    assert row["measured_s"] == pytest.approx(0.10) and row["recorded_s"] == pytest.approx(0.12)
    assert row["ratio"] == pytest.approx(0.8)
    assert row["bare_step_s"] == pytest.approx(0.08) and row["bare_ratio"] == pytest.approx(1.0)


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_layout_rows_cover_every_model_and_layout(quick):
    rows = quick["results"]["sections"]["layouts"]["rows"]
    assert {r["model"] for r in rows} == {"tiny", "small", "mxnet_ptb"}
    for model in ("tiny", "small", "mxnet_ptb"):
        layouts = {r["layout"]: r for r in rows if r["model"] == model}
        assert set(layouts) == set(LAYOUTS)  # every model has at least 4 blocks: pp4 fits
        assert layouts["1 process"]["ratio"] == 1.0 and layouts["1 process"]["threads"] == 2
        assert layouts["pp4 balanced"]["processes"] == 4 and layouts["pp4 balanced"]["partition"].count("|") == 3
        assert layouts["pp2 even"]["m"] == 2 and layouts["pp2 even"]["partition"].count("|") == 1
        for row in layouts.values():
            assert _finite_positive(row["tokens_per_s"]) and _finite_positive(row["ratio"])
            assert math.isclose(row["ratio"], row["tokens_per_s"] / layouts["1 process"]["tokens_per_s"])


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_partition_regret_tries_every_contiguous_split(quick):
    section = quick["results"]["sections"]["partition_regret"]
    rows = section["rows"]
    blocks = QUICK.regret_model["num_layers"] + 2
    splits = [r for r in rows if r["setting"] != "balanced"]
    assert len(splits) == blocks - 1 and len({r["split"] for r in splits}) == blocks - 1
    balanced = next(r for r in rows if r["setting"] == "balanced")
    assert balanced["split"] in {r["split"] for r in splits}  # it chose one of the contiguous splits
    assert min(r["ratio_to_best"] for r in splits) == 1.0
    for row in rows:
        assert row["max_over_mean"] >= 1.0 and len(row["stage_s"]) == 2
    assert [g["value"] for g in section["goals"]] == [balanced["ratio_to_best"], balanced["max_over_mean"]]


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_bucketing_rows_have_fractions_and_speeds(quick):
    rows = {r["buckets"]: r for r in quick["results"]["sections"]["bucketing"]["rows"]}
    none = rows["none (pad to longest)"]
    assert len(none["lengths"]) == 1 and none["speedup"] == 1.0
    assert rows["mxnet"]["lengths"] == [8, 16, 24, 32, 60]
    for row in rows.values():
        assert 0.0 <= row["padded_fraction"] <= 1.0 and 0.0 <= row["batch_padded_fraction"] <= 1.0
        assert _finite_positive(row["real_tokens_per_s"])
    # PTB sentence lengths: padding to the longest wastes the most, more buckets waste less.
    assert none["padded_fraction"] > max(r["padded_fraction"] for k, r in rows.items() if k != none["buckets"])
    assert rows["auto (10 buckets)"]["padded_fraction"] < rows["auto (5 buckets)"]["padded_fraction"]


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_memory_overhead_and_advice_sections(quick):
    sections = quick["results"]["sections"]
    memory = sections["memory"]["rows"]
    assert {r["layout"] for r in memory} == set(QUICK.memory_layouts)
    assert len([r for r in memory if r["layout"] == "pp2"]) == 2
    pp2 = [r for r in memory if r["layout"] == "pp2"]
    single = next(r for r in memory if r["layout"] == "1 process")
    assert sum(r["params"] for r in pp2) == single["params"]  # the ranks hold the model between them
    assert all(r["training_mib"] >= r["floor_mib"] > 0 for r in memory)
    overhead = sections["strategy_overhead"]
    assert [(r["layout"], r["schedule"]) for r in overhead["rows"]] == [("pp2", "1F1B")]  # QUICK's one comparison
    for row in overhead["rows"]:
        assert _finite_positive(row["bare_tokens_per_s"]) and _finite_positive(row["strategy_tokens_per_s"])
        assert math.isclose(row["pooled_ratio"], row["strategy_tokens_per_s"] / row["bare_tokens_per_s"])
        assert row["ratio"] == pytest.approx(float(row["round_ratios"]), abs=5e-4)  # QUICK's one round, as printed
        assert re.fullmatch(r"r0 [\d.]+ / [\d.]+ \([\d.]+ \+ [\d.]+\); r1 [\d.]+ / [\d.]+ \([\d.]+ \+ [\d.]+\)",
                            row["outside_ms"]), row["outside_ms"]
    assert [g["name"] for g in overhead["goals"]] == ["pp2 1F1B: mp_lstm / bare tokens per second"]
    advice = sections["advice"]["rows"]
    assert {r["model"] for r in advice} == {"tiny", "small", "mxnet_ptb"}
    for model in ("tiny", "small", "mxnet_ptb"):
        rows = [r for r in advice if r["model"] == model]
        assert sorted(r["predicted_rank"] for r in rows) == sorted(r["measured_rank"] for r in rows) == [1, 2, 3]
        assert {r["layout"] for r in rows} == {"1 process", "dp2", "pp2 balanced, m=auto"}
        for row in rows:  # each prediction's error against the measured step, from the row's own numbers
            assert row["predicted_over_measured"] == pytest.approx(row["predicted_s"] / row["measured_s"])
    names = [g["name"] for g in sections["advice"]["goals"]]
    assert len(names) == 6 and sum("the worst prediction's error" in n for n in names) == 3


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_wavefront_section_compares_time_chunks_with_row_microbatches(quick):
    section = quick["results"]["sections"]["wavefront"]
    rows = {r["variant"]: r for r in section["rows"]}
    runs = QUICK.wave_runs[2]
    expected = {"1 process"} | {f"pp2 GPipe, m={m}" for m in runs["m"]} | {f"pp2 wavefront, k={k}" for k in runs["k"]}
    assert set(rows) == expected | {f"pp2 wavefront, m={m} x k={k}" for m, k in runs["mk"]}
    assert rows["1 process"]["x_one_process"] == 1.0 and rows["1 process"]["bound_s"] is None
    for name, row in rows.items():
        assert len(row["peak_mib"]) == row["processes"] and all(p >= f > 0 for p, f in zip(row["peak_mib"],
                                                                                            row["floor_mib"]))
        if row["processes"] == 2:  # every pipeline against its own bound, over m x k units
            assert row["units"] == row["m"] * row["k"] and _finite_positive(row["bound_s"]) and row["ratio"] > 0
            assert row["bubble_predicted"] == pytest.approx(1 / (row["units"] + 1))
    k = runs["k"][0]
    assert (rows[f"pp2 wavefront, k={k}"]["m"], rows[f"pp2 wavefront, k={k}"]["k"]) == (1, k)
    assert [g["name"].split(":")[0] for g in section["goals"]] == ["pp2", f"pp2 wavefront k={k}",
                                                                    f"pp2 wavefront k={k}"]


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_page_mentions_every_section_and_shows_the_pictures(quick):
    page, results = quick["page"], quick["results"]
    for section in results["sections"].values():
        assert f"## {section['title']}" in page
    assert "## When does pipelining pay" in page
    assert set(results["pictures"]) == {"pp2", "dp2_pp2", "wavefront_pp2"}
    for path in results["pictures"].values():
        picture = Path(path)
        assert picture.is_file() and picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({picture.name})" in page  # beside the page: referenced by its relative path
    assert results["machine"]["cpu"] in page and results["command"] in page


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_page_renders_from_the_json_alone(quick, tmp_path):
    again = quick["out"] / "again.md"
    result = run_command([sys.executable, str(SCRIPT), "--render", str(again), "--json",
                          str(quick["out"] / "results.json")], timeout=60)
    assert result.returncode == 0, result.stdout[-4000:]
    assert again.read_text() == quick["page"]
    elsewhere = tmp_path / "docs" / "results.md"
    assert run.main(["--render", str(elsewhere), "--json", str(quick["out"] / "results.json")]) == 0
    text = elsewhere.read_text()
    for path in quick["results"]["pictures"].values():  # the links follow the page
        link = Path(os.path.relpath(path, elsewhere.parent))
        assert f"]({link.as_posix()})" in text and (elsewhere.parent / link).is_file()


@pytest.mark.timeout(300)
@pytest.mark.processes
def test_broken_results_are_refused(quick, tmp_path):
    good = quick["results"]
    breakages = {
        "a section is missing": lambda r: r["sections"].pop("bucketing"),
        "a ratio is not finite": lambda r: r["sections"]["pipeline_bound"]["rows"][0].update(ratio=float("nan")),
        "a padded fraction above 1": lambda r: r["sections"]["bucketing"]["rows"][0].update(padded_fraction=1.5),
        "tokens/s of zero": lambda r: r["sections"]["layouts"]["rows"][0].update(tokens_per_s=0.0),
        "a goal's flag disagrees": lambda r: r["sections"]["partition_regret"]["goals"][0].update(
            met=not r["sections"]["partition_regret"]["goals"][0]["met"]),
        "a row lacks a field": lambda r: r["sections"]["memory"]["rows"][0].pop("training_mib"),
        "no machine": lambda r: r.pop("machine"),
    }
    for what, breakage in breakages.items():
        broken = copy.deepcopy(good)
        breakage(broken)
        with pytest.raises(SchemaError):
            validate(broken)
            pytest.fail(f"accepted results with {what}")
    broken = copy.deepcopy(good)
    broken["sections"]["strategy_overhead"]["rows"][0]["strategy_tokens_per_s"] = -1.0
    path = tmp_path / "broken.json"
    path.write_text(json.dumps(broken))
    assert run.main(["--render", str(tmp_path / "page.md"), "--json", str(path)]) == 2
    assert not (tmp_path / "page.md").exists()


# ----- the GPU rows: --device cuda ------------------------------------------------------------------------------
@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal without CUDA")
def test_device_cuda_is_refused_before_measuring_without_cuda(tmp_path, capsys):
    assert run.main(["--device", "cuda", "--quick", "--out", str(tmp_path)]) == 2
    assert "--device cuda refused: CUDA is not available" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing measured, nothing written
    with pytest.raises(SystemExit):  # a CPU-only section is an argument error, whatever the machine
        run.main(["--device", "cuda", "--only", "advice"])
    assert "advice is CPU-only" in capsys.readouterr().err


def test_device_cuda_needs_a_gpu_per_process_of_its_sections(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert run.cuda_problem(QUICK, ["bucketing", "partition_regret"]) is None
    problem = run.cuda_problem(QUICK, ["layouts"])
    assert problem is not None and "2 GPU(s) are visible" in problem


def test_the_page_has_a_place_for_the_gpu_rows(tmp_path):
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    page = tmp_path / "results.md"
    assert run.main(["--render", str(page), "--json", str(ROOT / "benchmarks" / "results.json")]) == 0
    assert "## GPU rows\n\nNot measured yet" in page.read_text()
    assert "`python benchmarks/run.py --device cuda`" in page.read_text()
    results["machine"].update(device="cuda", gpus=2, gpu="NVIDIA H100", cuda="12.8")
    (tmp_path / "cuda.json").write_text(json.dumps(results))
    assert run.main(["--render", str(page), "--json", str(tmp_path / "cuda.json")]) == 0
    assert "Every row of this page is CUDA: 2 x NVIDIA H100" in page.read_text()


def test_the_main_job_summary_finds_a_stalled_step_among_its_shape():
    """A step twice as slow as the others of its shape is the stall; a long bucket's slow step is not."""
    rows = [{"step": 10 + i, "step_s": 0.01 * (2 if i % 2 else 1), "tail": 0.05, "tokens_per_s": 1000.0,
             "elements": 64.0 * (2 if i % 2 else 1)} for i in range(9)]  # two shapes, one twice the other's time
    calm = main_job.summarize(rows)
    assert calm["shapes"] == 2 and calm["slowest_over_its_shape_median"] == pytest.approx(1.0)
    assert calm["median_tail"] == pytest.approx(0.05) and all(calm["goals"].values())
    rows[4] = {**rows[4], "step_s": 0.02, "tail": 0.5}
    stalled = main_job.summarize(rows)
    assert stalled["slowest_step"] == 14 and stalled["slowest_over_its_shape_median"] == pytest.approx(2.0)
    assert stalled["goals"] == {"median tail <= 0.10": True, "slowest step / its shape's median <= 1.5": False}


def test_a_shapes_first_step_is_warm_up_reported_apart():
    """The first step of a shape builds its stages: however slow, it is listed apart and never the stall; steps
    before the window only tell which steps those are."""
    rows = [{"step": i, "step_s": 0.01, "tail": 0.05, "tokens_per_s": 1000.0, "elements": 64.0} for i in range(8)]
    rows.append({"step": 8, "step_s": 0.05, "tail": 0.01, "tokens_per_s": 200.0, "elements": 128.0})  # new shape
    rows += [{"step": 9 + i, "step_s": 0.02, "tail": 0.05, "tokens_per_s": 1000.0, "elements": 128.0}
             for i in range(3)]
    summary = main_job.summarize(rows, first=4)
    assert summary["steps"] == 7  # steps 4-7 and 9-11; step 8 is the new shape's first
    assert summary["first_of_shape"] == {8: pytest.approx(2.5)}
    assert summary["slowest_over_its_shape_median"] == pytest.approx(1.0) and all(summary["goals"].values())
    rows[10] = {**rows[10], "step_s": 0.04}  # a later step of that shape stalls: counted
    assert main_job.summarize(rows, first=4)["slowest_step"] == 10


def test_replica_sums_are_judged_per_round_against_the_librarys_sums():
    medians = {"sums": [0.10, 0.20, 0.10], "replicate": [0.13, 0.24, 0.10], "ddp": [0.09, 0.22, 0.11]}
    assert replica_sums.summarize(medians) == pytest.approx({"sums": 1.0, "replicate": 1.2, "ddp": 1.1})


@pytest.mark.timeout(180)
@pytest.mark.processes
def test_the_four_ways_replicas_sum_their_gradients_train_the_same_model():
    """The library's sums after and during the backward pass, torch's replicate and DDP step the same gradient (the
    global batch's mean loss's); the sums posted during the backward pass are the same sums, to the bit."""
    setup = replica_sums.Setup(vocab_size=50, embedding_dim=8, hidden_size=8, num_layers=2, rows=4, length=6,
                               optimizer="adam", lr=0.01)
    first = run_ranks(replica_sums._worker, 2, 1, 3, 1, setup, timeout=150)[0]
    assert set(first["medians"]) == set(replica_sums.VARIANTS)
    assert all(len(times) == 1 and times[0] > 0 for times in first["medians"].values())
    assert first["apart"]["sums"] == 0.0 and first["apart"]["overlapped"] == 0.0
    assert first["apart"]["ddp"] < 1e-6 and first["apart"]["replicate"] < 1e-5


def test_the_main_jobs_tail_is_held_against_the_floor_at_the_floors_own_shape():
    """A tail's share grows as steps shorten: the goal compares the main job's steps of the bare loop's shape; the
    whole bucket mix's median stays beside it, and stands in when no step had that shape."""
    setup = main_job.Setup(vocab_size=50, embedding_dim=8, hidden_size=8, num_layers=2, rows=4, length=5)
    short = [{"step": i, "step_s": 0.010, "tail": 0.30, "tokens_per_s": 1.0, "elements": 8.0} for i in range(5)]
    floor_shape = [{"step": 5 + i, "step_s": 0.020, "tail": 0.15, "tokens_per_s": 1.0, "elements": 20.0}
                   for i in range(4)]
    summary = main_job.summarize(short + floor_shape)
    assert summary["by_shape"][20.0] == {"steps": 3, "median_step_s": 0.02, "median_tail": 0.15,
                                         "median_tail_s": pytest.approx(0.003)}
    floor = {"median_outside_schedule": 0.12, "median_step_s": 0.025, "median_outside_s": 0.0025}
    held = main_job.against_floor(summary, floor, setup)
    assert held["tail_over_floor_points"] == pytest.approx(3.0) and held["floor_shape_steps"] == 3
    assert held["mix_tail_over_floor_points"] == pytest.approx(18.0)  # the mix's median is a short step's tail
    assert held["tail_ms_at_floor_shape"] == pytest.approx(3.0) and held["floor_tail_ms"] == pytest.approx(2.5)
    elsewhere = main_job.against_floor(main_job.summarize(short), floor, setup)
    assert elsewhere == {"tail_over_floor_points": pytest.approx(18.0),
                         "mix_tail_over_floor_points": pytest.approx(18.0), "floor_shape_steps": 0}


def test_three_loops_rotates_their_order_and_takes_each_loops_median_over_rounds(monkeypatch):
    """Lightning's own share of the step outside its schedule and the strategy's share on top of it, from rounds
    whose order rotates (each loop first once in three rounds)."""
    order: list[str] = []
    # Per loop: a 20 ms step of which (ms) outside the schedule, round by round.
    outside = {"bare": iter([2.0, 3.0, 2.5]), "plain": iter([4.0, 6.0, 5.0]), "mp_lstm": iter([5.5, 5.0, 7.0])}

    def fake(name: str) -> dict:
        order.append(name)
        ms = next(outside[name])
        return {"intervals": [0.020] * 3, "schedule": [0.020 - ms / 1e3] * 3, "norms": []}

    monkeypatch.setattr(main_job, "single_loop", lambda steps, setup: fake("bare"))
    monkeypatch.setattr(main_job, "lightning_loop", lambda steps, setup, strategy: fake(strategy))
    got = main_job.three_loops(first=0, steps=3, rounds=3)
    assert order == ["bare", "plain", "mp_lstm", "plain", "mp_lstm", "bare", "mp_lstm", "bare", "plain"]
    assert got["bare"]["outside_ms"] == pytest.approx([2.0, 3.0, 2.5])
    assert got["bare"]["median_outside_ms"] == pytest.approx(2.5)
    assert got["plain"]["median_outside_points"] == pytest.approx(25.0)  # 5 of 20 ms
    assert got["mp_lstm"]["median_outside_ms"] == pytest.approx(5.5)
    assert got["plain_over_bare_ms"] == pytest.approx(2.5) and got["plain_over_bare_points"] == pytest.approx(12.5)
    assert got["mp_lstm_over_plain_ms"] == pytest.approx(0.5) and got["mp_lstm_over_plain_points"] == pytest.approx(2.5)


@pytest.mark.timeout(180)
@pytest.mark.processes
def test_the_main_job_benchmark_measures_the_bare_loop_beside_it():
    """The machine's own noise floor: the bare pipelining loop's steps on two ranks, their slowest over their median and
    the share of a step outside ``schedule.step``."""
    setup = main_job.Setup(vocab_size=50, embedding_dim=8, hidden_size=8, num_layers=2, rows=8, length=6,
                           microbatches=2)
    floor = main_job.bare_floor(2, 4, setup)
    assert floor["median_step_s"] > 0 and floor["slowest_over_median"] >= 1.0
    assert 0.0 < floor["median_outside_schedule"] < 1.0
    assert floor["setup"]["rows"] == 8 and floor["setup"]["schedule"] == "1F1B"


@pytest.mark.timeout(180)
@pytest.mark.processes
def test_the_bare_loop_clips_by_the_whole_models_norm_as_the_main_job_does():
    """The main job's floor clips by the global norm and steps Adam: both stages see the norm of the whole model's
    gradient (one process's, at the first step), and the floor is measured with the main job's optimizer and clip."""
    import torch
    from torch import nn

    from benchmarks import overhead
    from lightning_mp_lstm.base.testing import run_ranks
    from lightning_mp_lstm.models.binding import pipeline_model
    from lightning_mp_lstm.models.lstm_language_model import token_loss_sum

    setup = overhead.Setup(vocab_size=50, embedding_dim=8, hidden_size=8, num_layers=2, rows=8, length=6,
                           microbatches=2, optimizer="adam", lr=0.005, clip=1e-3)
    first, second = (rank["norms"] for rank in run_ranks(main_job._bare_worker, 2, 2, setup, timeout=150))
    model = overhead.model_of(setup)  # its blocks end with the decoder's inputs: the decoder applied after them
    whole = nn.Sequential(*[module for _, module in pipeline_model(model).blocks()], model.decoder)
    inputs, targets = overhead.batches(1, setup)[0]
    (token_loss_sum(whole(inputs), targets) / (setup.rows * setup.length)).backward()
    expected = float(torch.nn.utils.get_total_norm([p.grad for p in whole.parameters()]))
    assert len(first) == 3 and first == pytest.approx(second, rel=1e-6)
    assert first[0] == pytest.approx(expected, rel=1e-4)
    assert first[1] != pytest.approx(first[0], rel=1e-6)  # Adam moved the weights between the steps
    assert main_job.BARE_SETUP.optimizer == "adam" and main_job.BARE_SETUP.clip == 0.25


def test_the_overhead_rounds_alternate_which_run_goes_first(one_process_group, monkeypatch):
    """ABBA: the bare loop first in even rounds, the strategy first in odd ones, every run's steps after warm-up
    pooled, then one recorded run for the time outside the schedule."""
    from benchmarks import overhead

    calls: list[str] = []

    def bare(rank: int, steps: int, setup: Any) -> dict[str, list[float]]:
        calls.append("bare")
        return {"intervals": [0.2] * steps, "schedule": [0.15] * steps, "norms": []}

    def fit(rank: int, steps: int, setup: Any, record: tuple[int, ...] = ()) -> dict[str, Any]:
        calls.append("recorded" if record else "strategy")
        return {"intervals": [0.25] * steps, "outside": {"before": 0.001, "after": 0.01, "wall": 0.25}}

    monkeypatch.setattr(overhead, "bare_loop", bare)
    monkeypatch.setattr(overhead, "strategy_fit", fit)
    result = overhead.compare(0, 6, 2, overhead.Setup(), rounds=4)
    assert calls == ["bare", "strategy", "strategy", "bare", "bare", "strategy", "strategy", "bare", "recorded"]
    assert len(result["bare"]) == len(result["strategy"]) == 4 * 4
    assert result["bare_outside"] == pytest.approx(0.05)
    assert result["rounds"] == [pytest.approx((0.2, 0.25))] * 4
    assert overhead.summarize(result)["ratio"] == pytest.approx(0.8)


def test_the_overhead_ratio_is_the_median_of_each_rounds_ratio():
    """The goal's ratio pairs each round's two runs (neighbours in time): a machine twice as slow in one round
    moves the pooled medians but not the rounds' ratios."""
    from benchmarks import overhead

    rounds = [(0.20, 0.21), (0.20, 0.20), (0.40, 0.42), (0.40, 0.42), (0.40, 0.40)]
    result = {"setup": asdict(overhead.Setup(rows=10, length=10)), "rounds": rounds,
              "bare": [0.20, 0.20, 0.40, 0.40, 0.40], "strategy": [0.21, 0.20, 0.42, 0.42, 0.40]}
    summary = overhead.summarize(result)
    assert summary["round_ratios"] == pytest.approx([0.2 / 0.21, 1.0, 0.4 / 0.42, 0.4 / 0.42, 1.0])
    assert summary["ratio"] == pytest.approx(0.4 / 0.42)
    assert summary["pooled_ratio"] == 1.0  # pooled, a slow round's steps stand in for the other run's
    assert summary["bare_tokens_per_s"] == pytest.approx(100 / 0.4)
    result["rounds"] = [(0.20, 0.21), (0.20, 0.20), (0.20, 0.20), (0.40, 0.42), (0.40, 0.40)]
    result["strategy"] = [0.21, 0.20, 0.20, 0.42, 0.40]
    assert overhead.summarize(result)["ratio"] == 1.0  # three of five rounds even


def test_the_autopilot_section_holds_the_schema_and_judges_the_pick_against_the_best_measured():
    """benchmarks/autopilot.py's section, from two jobs' results (its runs take minutes: docs/autopilot.md)."""
    from benchmarks import autopilot
    from benchmarks.render import render

    def row(name, predicted, measured=None, fits=True):
        out = {"candidate": name, "processes": 2, "fits": fits, "peak_mib": 600.0, "predicted_s": predicted,
               "predicted_rank": 1}
        return {**out, "measured_s": measured, "predicted_over_measured": predicted / measured} if measured else out

    jobs = [{"job": "main", "overrides": [], "pick": "dp2", "best": "pp2", "pick_over_best": 1.2,
             "rows": [row("dp2", 0.01, 0.012), row("pp2", 0.011, 0.010)]},
            {"job": "vocab", "overrides": ["strategy.memory_per_process=1.1"], "pick": "pp2", "best": "pp2",
             "pick_over_best": 1.0, "rows": [row("pp2", 0.5, 0.5), row("dp2", 0.4, fits=False)]}]
    section = autopilot.section(jobs, "python benchmarks/autopilot.py", "2026-11-28")
    goals = {g["name"].split(":")[0] + ("/pick" if "pick" in g["name"] else "/error"): g for g in section["goals"]}
    assert not goals["main/pick"]["met"] and goals["main/pick"]["value"] == 1.2
    assert goals["main/error"]["value"] == pytest.approx(1 - 0.01 / 0.012) and goals["main/error"]["met"]
    assert goals["vocab/pick"]["met"] and goals["vocab/error"]["value"] == 0.0
    assert [r["measured_s"] for r in section["rows"]] == [0.012, 0.010, 0.5, None]
    results = json.loads((ROOT / "benchmarks" / "results.json").read_text())
    results["sections"]["autopilot"] = section
    validate(results, (*SECTIONS, "autopilot"))
    page = render(results)
    assert "The autopilot (layout=auto): predicted against measured" in page and "| vocab | dp2 | 2 | **no** |" in page
    # The mean the prediction stands for: from step 2 on, each shape's first step left out.
    steps = [{"step": s, "elements": e, "step_s": t} for s, e, t in [(0, 1, 9.0), (1, 2, 9.0), (2, 1, 1.0),
                                                                     (3, 2, 3.0), (4, 3, 9.0), (5, 3, 2.0)]]
    assert autopilot.mean_step(steps, first=2) == 2.0
    # A run of one job replaces that job and keeps the others, each with its own date and command.
    earlier = {"command": "python benchmarks/autopilot.py", "date": "2026-11-27", "jobs": jobs}
    again = {**jobs[1], "pick_over_best": 1.05, "date": "2026-11-28", "command": "autopilot.py --jobs vocab"}
    merged = autopilot.merge_jobs(earlier, {"command": again["command"], "date": "2026-11-28", "jobs": [again]})
    assert [j["job"] for j in merged["jobs"]] == ["main", "vocab"] and merged["jobs"][1]["pick_over_best"] == 1.05
    assert merged["jobs"][0]["date"] == "2026-11-27" and merged["date"] == "2026-11-28"
    assert merged["command"] == "autopilot.py --jobs vocab; python benchmarks/autopilot.py"
    # A run of the same job up to 4 processes is a job of its own, after the one of the machine's cores.
    wider = {**jobs[0], "overrides": ["layout.processes=4"], "date": "2026-11-29", "command": "--override"}
    merged = autopilot.merge_jobs(merged, {"command": "--override", "date": "2026-11-29", "jobs": [wider]})
    assert [autopilot.job_label(j) for j in merged["jobs"]] == ["main", "main, up to 4 processes", "vocab"]
    assert autopilot.section([wider], "c", "d")["rows"][0]["job"] == "main, up to 4 processes"

    # Each job says when it was measured (one without a date: the run's).
    assert "vocab: strategy.memory_per_process=1.1 (one run of each candidate, 2026-11-28)" in section["setup"]


def test_the_autopilot_benchmark_runs_its_candidates_in_turns_and_takes_each_ones_median(monkeypatch):
    """``--rounds``: every candidate that fits runs once per round, the candidates taking turns, and its measured
    step is the median of its runs (a candidate that does not fit never runs)."""
    import subprocess
    from types import SimpleNamespace

    from benchmarks import autopilot

    # The autopilot chose the second (a tie: one process), so the pick is not the fastest predicted.
    ranked = [{"candidate": name, "processes": 2, "predicted_s": 1.0, "fits": fits, "peak_mib": 1.0,
               "chosen": name == "single", "settings": {"data_parallel_size": dp, "pipeline_parallel_size": 1,
                                                        "schedule": "1F1B", "n_microbatches": 1}}
              for name, dp, fits in [("dp2", 2, True), ("single", 1, True), ("dp4", 4, False)]]
    stdout = "table\ncalibrated: 2 threads 1.90x\n" + json.dumps(ranked)
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(stdout=stdout))
    runs = []
    steps = {"dp2": iter([5.0, 1.0, 2.0]), "single": iter([3.0, 9.0, 4.0])}

    def measure(first, count, command):
        name = "dp2" if any("data_parallel_size=2" in c for c in command) else "single"
        runs.append(name)
        return [{"step": 9, "elements": 1.0, "step_s": 0.0}, {"step": 10, "elements": 1.0, "step_s": next(steps[name])}]

    monkeypatch.setattr(autopilot, "measure", measure)
    job = autopilot.run_job("main", [], first=5, steps=30, rounds=3)
    assert runs == ["dp2", "single"] * 3
    assert [r.get("measured_s") for r in job["rows"]] == [2.0, 4.0, None]
    assert job["rows"][0]["measured_rounds"] == [5.0, 1.0, 2.0] and job["rounds"] == 3
    assert job["pick"] == "single" and job["best"] == "dp2" and job["pick_over_best"] == 2.0
    assert job["calibrated"] == "2 threads 1.90x"
    assert "main: python train.py as it is (the median of 3 runs of each candidate, " in autopilot.section(
        [job], "python benchmarks/autopilot.py", "2026-11-28")["setup"]


@pytest.mark.processes
def test_a_run_of_some_sections_keeps_the_others_and_the_page_says_where_each_came_from(quick, tmp_path):
    """``benchmarks/run.py --only S`` into results that hold every section replaces S alone (a partial run once
    wrote a file of one section over the full run's), and the page names the later run beside the full one."""
    from benchmarks.render import write_page

    full = quick["results"]
    name = "strategy_overhead"
    later = copy.deepcopy(full)
    later.update(command=f"python benchmarks/run.py --quick --only {name}", date="2026-11-28T04:38:32+00:00",
                 duration_s=120.0, sections={name: later["sections"][name]})
    later["sections"][name]["rows"][0]["ratio"] = 0.5
    both = run.merged(full, later)
    assert set(both["sections"]) == set(full["sections"])
    assert both["sections"][name]["rows"][0]["ratio"] == 0.5
    assert all(both["sections"][s] == full["sections"][s] for s in full["sections"] if s != name)
    assert both["command"] == full["command"] and [u["sections"] for u in both["updates"]] == [[name]]
    assert [u["command"] for u in run.merged(both, later)["updates"]] == [later["command"]]  # the older one replaced
    validate(both, list(full["sections"]))
    write_page(both, tmp_path / "results.md")
    text = (tmp_path / "results.md").read_text()
    assert f"`{full['command']}`" in text and f"come from a later run instead: `{later['command']}`" in text
    assert run.merged({**full, "mode": "full"}, later) is later  # a quick run never mixes into full results


def test_the_main_jobs_floor_is_measured_in_the_layout_the_job_ran():
    """``python train.py`` runs what ``layout=auto`` picks (one process on 2 cores): the floor beside it is then one
    process's plain loop, read from the layout the run printed; a layout without a bare loop gets none."""
    line = ("mp_lstm: ParallelLayout(data_parallel_size={}, pipeline_parallel_size={}, stages_per_rank=1, "
            "schedule='1F1B', n_microbatches=2, tensor_parallel_size=1, time_chunks=1)\n")
    assert main_job.ran_layout(["noise\n", line.format(1, 1)]) == "single"
    assert main_job.ran_layout([line.format(1, 2)]) == "pp2" and main_job.ran_layout([line.format(2, 2)]) == "dp2_pp2"
    assert main_job.ran_layout([line.format(2, 1)]) is None and main_job.ran_layout(["no layout\n"]) is None
    setup = main_job.Setup(vocab_size=50, embedding_dim=8, hidden_size=8, num_layers=2, rows=8, length=6,
                           optimizer="adam", lr=0.005, clip=0.25)
    floor = main_job.bare_floor(2, 4, setup, layout="single")
    assert floor["layout"] == "single" and floor["median_step_s"] > 0 and 0.0 < floor["median_outside_schedule"] < 1


class _Clocked:
    """A stand-in for a clocked part: its method takes as long as it is told."""

    def work(self, seconds: float) -> str:
        import time

        time.sleep(seconds)
        return "done"


def test_step_parts_clocks_each_part_and_leaves_lightnings_closure_as_the_rest(monkeypatch):
    """``benchmarks/step_parts.py``: a clock around a named method keeps its result and times every call; the rest
    of the optimizer step is what its own parts do not account for."""
    from benchmarks import step_parts

    monkeypatch.setattr(_Clocked, "work", _Clocked.work)  # restored after the test
    seconds = step_parts.clocked({"work": ("tests.test_benchmark_suite", "_Clocked.work")})
    assert _Clocked().work(0.01) == "done" and _Clocked().work(0.02) == "done"
    assert len(seconds["work"]) == 2 and 0.01 <= seconds["work"][0] < seconds["work"][1]

    per_call = {"loop step (Lightning's advance)": 40.0, "optimizer step, closure included": 36.0,
                "training step": 30.0, "zero_grad": 0.25, "gradients handed to backward": 0.1,
                "clip by the global norm": 0.9, "Adam kernel (fused)": 0.6, "LightningModule.log": 1.3}
    calls = {label: [1e-3 * ms] * 10 for label, ms in per_call.items()}
    calls["LightningModule.log"] = [5.0] * 2 + [1.3e-3] * 18  # two calls a step; the first step's were slow
    rows = {r["part"]: r for r in step_parts.summarize(calls, steps=10, first=1)}
    assert rows["LightningModule.log"]["calls_per_step"] == 2.0
    assert rows["LightningModule.log"]["median_ms"] == pytest.approx(1.3)
    rest = rows["Lightning's closure and hooks (the rest of the optimizer step)"]["median_ms"]
    assert rest == pytest.approx(36.0 - 30.0 - 0.25 - 0.1 - 0.9 - 0.6)

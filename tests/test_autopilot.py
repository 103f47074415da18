"""layout=auto: every layout ranked by predicted step time among those that fit in memory, the fastest run, and every
rank process running the launching process's choice."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
from types import SimpleNamespace

import pytest
import torch

from lightning_mp_lstm.app import autopilot as app_autopilot
from lightning_mp_lstm.app import step_cost
from lightning_mp_lstm.app.training import build_model, build_strategy
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.planning import advice
from lightning_mp_lstm.planning.advice import Candidate
from lightning_mp_lstm.planning.autopilot import (
    TIE,
    RankedLayout,
    candidate_layout,
    choose,
    rank_layouts,
    render_ranking,
)
from lightning_mp_lstm.planning.calibration import Calibration
from lightning_mp_lstm.planning.memory import GIB, BatchShape, ModelMemory
from tests.helpers import SMALL_SYNTHETIC, TINY_RUN, run_command, tiny_model

CPU = torch.device("cpu")
PER_ROW = {"embedding": 0.001, "lstm.0": 0.004, "lstm.1": 0.004, "decoder": 0.003}


@pytest.fixture
def block_times(monkeypatch):
    """Every block costs ``PER_ROW[block] * rows`` seconds on one thread."""
    monkeypatch.setattr(advice.profile, "block_seconds",
                        lambda model, names, rows, *args, **kwargs: {n: PER_ROW[n] * rows for n in names})


def _memory(model) -> ModelMemory:
    """The tiny model's memory with 1 GiB of parameters per LSTM layer (so budgets decide what fits)."""
    names = list(pipeline_model(model).block_names)
    return ModelMemory(parameters={n: GIB if n.startswith("lstm") else 1 for n in names},
                       activations={n: 1.0 for n in names}, vocabulary=37, slice_tokens=None, optimizer_factor=0.0)


def test_the_fastest_layout_that_fits_is_chosen_and_the_others_say_why_they_lose(block_times):
    model = tiny_model(num_layers=2)
    # Two processes run no faster than one here (no thread speed-up), so splitting wins on time ...
    calibration = Calibration(((1, 1.0), (2, 1.0)), float("inf"))
    ranked = rank_layouts(model, [2], 16, 10, CPU, calibration, memory=_memory(model),
                          batch_for=lambda layout: BatchShape(16 // layout.data_parallel_size, 10),
                          budget_for=lambda layout: (int(3.5 * GIB), "test"), cores=2)
    # ... but a whole model holds 2 GiB of parameters, 2 of gradients and a layer's gradient while it is computed:
    # over the 3.5 GiB budget, so one process and dp2 do not fit, and a pipeline (one layer per process) is chosen.
    fits = {r.name: r.fits for r in ranked}
    assert not fits["1 process (2 threads)"] and not fits["dp2"]
    best = choose(ranked)
    assert best.processes == 2 and best.layout.pipeline_parallel_size == 2
    assert best.candidate.predicted_seconds == min(r.candidate.predicted_seconds for r in ranked if r.fits)
    table = render_ranking(ranked, tokens=160)
    lines = {line.split("  ")[0].strip(): line for line in table.splitlines()[2:]}
    assert lines[best.name].endswith("chosen")
    assert "does not fit: 5.00 of 3.50 GiB" in lines["1 process (2 threads)"]
    slower = next(r for r in ranked if r.fits and r is not best)
    ratio = slower.candidate.predicted_seconds / best.candidate.predicted_seconds
    assert lines[slower.name].endswith(f"{ratio:.2f}x slower")


def test_one_process_wins_when_threads_scale_and_nothing_fits_is_refused_with_the_table(block_times):
    model = tiny_model(num_layers=2)
    perfect = Calibration(((1, 1.0), (2, 2.0)), float("inf"), crowding=((2, 1.5),))
    ranked = rank_layouts(model, [2], 16, 10, CPU, perfect, cores=2)
    assert choose(ranked).name == "1 process (2 threads)" and choose(ranked).settings() == {
        "data_parallel_size": 1, "pipeline_parallel_size": 1, "schedule": "1F1B", "n_microbatches": 1,
        "time_chunks": None, "shard_replicas": False}
    tight = rank_layouts(model, [2], 16, 10, CPU, perfect, memory=_memory(model),
                         batch_for=lambda layout: BatchShape(16, 10), budget_for=lambda layout: (GIB, "test"),
                         cores=2)
    # None fits: the one that needs the least (a layer per process) is handed on, for its refusal to say what to do.
    assert not any(r.fits for r in tight) and choose(tight).layout.pipeline_parallel_size == 2
    assert "does not fit: 5.00 of 1.00 GiB" in render_ranking(tight) and "chosen" not in render_ranking(tight)


def _ranked(name: str, dp: int, pp: int, seconds: float) -> RankedLayout:
    candidate = Candidate(name, dp, pp, pp, (("embedding",),) * pp, 1, seconds)
    return RankedLayout(candidate, candidate_layout(candidate, "1F1B"), None)


def test_a_candidate_less_than_the_tie_faster_loses_to_one_on_fewer_processes():
    one = _ranked("1 process (2 threads)", 1, 1, 1.0)
    close = _ranked("dp2", 2, 1, 0.96)
    assert TIE == 0.10 and choose([close, one]) is one
    lines = render_ranking([close, one]).splitlines()
    assert lines[2].endswith("0.96x: a tie, on more processes") and lines[3].endswith("chosen")
    # Outside the tie the fastest wins; inside it the fewest processes, and the faster of those.
    far = _ranked("dp2", 2, 1, 0.85)
    assert choose([far, one]) is far
    four, two, slow_two = (_ranked("dp2 x pp2 balanced, m=2", 2, 2, 0.90), _ranked("pp2 balanced, m=2", 1, 2, 0.95),
                           _ranked("pp2 wavefront, m=1 x k=2", 1, 2, 0.97))
    assert choose([four, two, slow_two, _ranked("1 process (2 threads)", 1, 1, 1.05)]) is two


def test_a_wavefront_choice_sets_the_schedule_and_both_axes(block_times, compose_train, monkeypatch):
    model = tiny_model(num_layers=2)
    ranked = rank_layouts(model, [2], 16, 12, CPU, Calibration(((1, 1.0),), float("inf")), cores=2)
    wavefront = next(r for r in ranked if "wavefront" in r.name)
    settings = wavefront.settings()
    assert settings["schedule"] == "Wavefront" and settings["time_chunks"] == wavefront.candidate.time_chunks > 1
    cfg = compose_train()
    monkeypatch.delenv(app_autopilot.CHOICE, raising=False)
    app_autopilot.apply_choice(cfg, settings)
    strategy = build_strategy(cfg)
    assert strategy.processes_for(None) == 2
    assert (cfg.schedule.name, cfg.schedule.n_microbatches, cfg.schedule.time_chunks) == (
        "Wavefront", settings["n_microbatches"], settings["time_chunks"])
    assert json.loads(os.environ[app_autopilot.CHOICE]) == settings


def test_where_replicas_do_not_fit_the_same_layout_with_replicas_that_shard_is_ranked_and_run(
        block_times, compose_train, monkeypatch):
    model = tiny_model(num_layers=2)
    calibration = Calibration(((1, 1.0), (2, 1.0)), float("inf"))

    def ranking(budget_gib: float, shard: bool = True) -> dict:
        return {r.name: r for r in rank_layouts(
            model, [2], 16, 10, CPU, calibration, memory=_memory(model), shard=shard,
            batch_for=lambda layout: BatchShape(16 // layout.data_parallel_size, 10),
            budget_for=lambda layout: (int(budget_gib * GIB), "test"), cores=2)}

    # A replica holds 2 GiB of parameters, 2 of gradients and a layer's gradient while it is computed (5 GiB);
    # sharded over two, 1 + 1 of its own, one layer gathered whole and the one being computed (4 GiB).
    ranked = ranking(4.5)
    assert not ranked["dp2"].fits and ranked["dp2 sharded"].fits
    assert ranked["dp2"].memory.peak - ranked["dp2 sharded"].memory.peak == pytest.approx(GIB, rel=1e-6)
    sharded = ranked["dp2 sharded"].settings()
    assert sharded["shard_replicas"] is True and sharded["data_parallel_size"] == 2
    assert "strategy.shard_replicas=true" in app_autopilot.layout_overrides(sharded)
    # Never where replicas fit (slower there), nor where sharding is not allowed.
    assert not any("sharded" in name for name in ranking(100.0))
    assert not any("sharded" in name for name in ranking(4.5, shard=False))
    cfg = compose_train()
    monkeypatch.delenv(app_autopilot.CHOICE, raising=False)
    app_autopilot.apply_choice(cfg, sharded)
    strategy = build_strategy(cfg)
    assert cfg.strategy.shard_replicas is True and strategy.processes_for(None) == 2
    assert strategy.may_shard("32-true") and not strategy.may_shard("16-mixed")
    assert not build_strategy(compose_train("+strategy.data_parallel_weights=[1,3]")).may_shard("32-true")
    assert not build_strategy(compose_train("strategy.verify=true")).may_shard("32-true")


def test_replicas_that_shard_pay_a_third_transfer_and_are_timed_with_their_memory_returned(block_times,
                                                                                           monkeypatch):
    model = tiny_model(num_layers=2)
    returned = []

    @contextlib.contextmanager
    def recorded():
        returned.append(True)
        yield True

    monkeypatch.setattr(advice, "freed_memory_returned", recorded)
    nbytes = 4 * sum(pipeline_model(model).analytic_costs("parameters", 1, 10).values())
    bandwidth, touch = 1e6, 4e6
    for first_touch, extra in ((0.0, 0.0), (touch, 2 * 3 * nbytes / touch)):
        calibration = Calibration(((1, 1.0), (2, 1.0)), bandwidth, first_touch=first_touch)
        plain = {c.name: c for c in advice.advise(model, [2], 16, 10, CPU, calibration, cores=2)}
        sharded = {c.name: c for c in advice.advise(model, [2], 16, 10, CPU, calibration, cores=2, sharded=True)}
        assert set(sharded) == {"dp2 sharded"} and returned and not any(c.sharded for c in plain.values())
        # A replica all-reduces its gradients (2 x 1/2 of the bytes); a shard gathers twice and reduce-scatters
        # once (3 x 1/2), filling what it gathers and reduces in fresh memory twice.
        difference = sharded["dp2 sharded"].predicted_seconds - plain["dp2"].predicted_seconds
        assert difference == pytest.approx(0.5 * nbytes / bandwidth + extra, rel=1e-9)


def test_a_sharded_wavefront_gathers_each_block_once_per_unit_and_once_more_for_the_backward(block_times):
    """The wavefront runs every unit's forward first (each gathers the block and reshards it after) and keeps a block
    gathered from its first backward to its last: ``m x k + 1`` gathers and one reduce-scatter a step, where
    replicas that do not shard all-reduce once (twice the bytes of one gather)."""
    model = tiny_model(num_layers=2)
    parameters = pipeline_model(model).analytic_costs("parameters", 1, 10)
    bandwidth = 1e6
    calibration = Calibration(((1, 1.0), (2, 1.0), (4, 1.0)), bandwidth)
    plain = {c.name: c for c in advice.advise(model, [4], 16, 10, CPU, calibration, cores=4)}
    sharded = {c.name: c for c in advice.advise(model, [4], 16, 10, CPU, calibration, cores=4, sharded=True)}
    wavefront = next(c for name, c in sharded.items() if name.startswith("dp2 x pp2 sharded wavefront"))
    assert wavefront.sharded and wavefront.time_chunks > 1
    same = plain[wavefront.name.replace(" sharded", "")]
    units = wavefront.n_microbatches * wavefront.time_chunks
    nbytes = max(4 * sum(parameters[b] for b in stage) for stage in wavefront.partition)
    difference = wavefront.predicted_seconds - same.predicted_seconds
    assert difference == pytest.approx(units * 0.5 * nbytes / bandwidth, rel=1e-9)


def test_a_layout_whose_plan_leaves_little_room_is_timed_with_its_freed_memory_returned(monkeypatch):
    """Such a process's steps return every freed buffer of 1 MiB or more (base.allocator.steady_threshold), which
    costs them page faults: its blocks are timed that way (here: twice as slow)."""
    returned = [False]

    @contextlib.contextmanager
    def recorded():
        returned[0] = True
        yield True
        returned[0] = False

    monkeypatch.setattr(advice, "freed_memory_returned", recorded)
    monkeypatch.setattr(advice.profile, "block_seconds", lambda model, names, rows, *args, **kwargs: {
        n: PER_ROW[n] * rows * (2 if returned[0] else 1) for n in names})
    model = tiny_model(num_layers=2)
    calibration = Calibration(((1, 1.0), (2, 1.0)), float("inf"))

    def ranking(budget_gib: float) -> dict:
        return {r.name: r for r in rank_layouts(
            model, [2], 16, 10, CPU, calibration, memory=_memory(model),
            batch_for=lambda layout: BatchShape(16 // layout.data_parallel_size, 10),
            budget_for=lambda layout: (int(budget_gib * GIB), "test"), cores=2)}

    roomy, tight = ranking(100.0), ranking(5.5)  # dp2 and one process need 5 GiB: over 3/4 of 5.5, under 5.5
    assert tight["dp2"].fits and tight["dp2"].memory.peak > 0.75 * tight["dp2"].memory.budget
    for name in ("dp2", "1 process (2 threads)"):
        assert tight[name].candidate.predicted_seconds == pytest.approx(2 * roomy[name].candidate.predicted_seconds)
    pipelines = [name for name in tight if name.startswith("pp2")]
    assert pipelines and all(not tight[n].memory.peak > 0.75 * tight[n].memory.budget for n in pipelines)
    assert all(tight[n].candidate.predicted_seconds == roomy[n].candidate.predicted_seconds for n in pipelines)
    # A wavefront's chunks are timed at their own length then, not on a line between two lengths.
    asked = []
    monkeypatch.setattr(advice.profile, "block_seconds", lambda model, names, rows, length, *args, **kwargs: (
        asked.append(length) or {n: PER_ROW[n] * rows * length / 10 for n in names}))
    advice.advise(model, [2], 16, 10, CPU, calibration, cores=2, only={(1, 2)}, time_chunks=(2, 4),
                  memory_returned=True)
    assert {5, 3} <= set(asked)


@pytest.mark.parametrize("overrides, reason", [
    (["partition=balanced4"], "the partition has a stage count"),
    (["layout.data_parallel_size=2"], "layout.data_parallel_size or layout.tensor_parallel_size is set"),
    (["schedule=wavefront"], "schedule Wavefront is not GPipe or 1F1B"),
    (["schedule.n_microbatches=4"], "schedule.n_microbatches is set"),
    (["trainer.num_nodes=2"], "the job spans several nodes"),
    (["layout=pp2"], "the layout is not auto"),
    (["strategy.shard_replicas=true"], "strategy.shard_replicas is set"),
    ([], None),
])
def test_a_command_that_fixes_part_of_the_layout_keeps_it(compose_train, overrides, reason):
    cfg = compose_train(*overrides)
    strategy = build_strategy(cfg)
    model = build_model(cfg, strategy, 37)
    assert app_autopilot.autopilot_declined(cfg, strategy, model) == reason


@pytest.mark.processes
def test_train_py_ranks_the_layouts_once_and_every_rank_runs_the_choice(tmp_path):
    """With trainer.devices=2 the autopilot ranks the two-process layouts; rank 1 takes the launching process's
    choice from the environment (it prints no table of its own) and trains the same layout."""
    args = [sys.executable, "train.py", *TINY_RUN, *SMALL_SYNTHETIC, "trainer.devices=2", "trainer.max_steps=2",
            "evaluate=false", f"hydra.run.dir={tmp_path}/run"]
    result = run_command(args, timeout=240)
    assert result.returncode == 0, result.stdout[-3000:]
    out = result.stdout
    assert out.count("mp_lstm: layout=auto ranked") == 1
    chosen = [line for line in out.splitlines() if line.rstrip().endswith("chosen")]
    assert len(chosen) == 1 and " 2 " in chosen[0]
    name = chosen[0].split("  ")[0]
    assert f"mp_lstm: training on {name}" in out
    dp = 2 if name == "dp2" else 1
    assert f"ParallelLayout(data_parallel_size={dp}, pipeline_parallel_size={2 // dp}" in out
    assert "Starting with 2 processes" in out


# ----- what a step costs beyond its blocks --------------------------------------------------------------------------
COSTS = {(1, 1, 1): 0.005, (2, 1, 1): 0.011, (1, 2, 2): 0.009, (1, 2, 8): 0.018, (1, 2, 8, 2): 0.024}


def test_a_step_cost_is_the_measured_kind_s_and_a_pipeline_s_grows_with_its_pieces():
    calibration = Calibration(((1, 1.0),), float("inf"), step_costs=tuple(COSTS.items()))
    assert calibration.step_cost(1, 1, 1) == 0.005 and calibration.step_cost(2, 1, 1) == 0.011
    assert calibration.step_cost(1, 2, 2) == 0.009 and calibration.step_cost(1, 2, 8) == pytest.approx(0.018)
    assert calibration.step_cost(1, 2, 4) == pytest.approx(0.009 + 2 * (0.018 - 0.009) / 6)
    # Two replicas of a pipeline: the pipeline's cost and what replication adds to one process.
    assert calibration.step_cost(2, 2, 2) == pytest.approx(0.009 + 0.011 - 0.005)
    assert Calibration(((1, 1.0),), float("inf")).step_cost(2, 2, 4) == 0.0  # not measured: nothing added
    # A wavefront of time chunks grows by its own line from the pipeline's fewest pieces; the pipeline's unmeasured.
    assert calibration.step_cost(1, 2, 8, chunked=True) == pytest.approx(0.024)
    assert calibration.step_cost(1, 2, 4, chunked=True) == pytest.approx(0.009 + 2 * (0.024 - 0.009) / 6)
    unchunked = Calibration(((1, 1.0),), float("inf"), step_costs=tuple(COSTS.items())[:4])
    assert unchunked.step_cost(1, 2, 4, chunked=True) == pytest.approx(calibration.step_cost(1, 2, 4))


def test_every_candidate_pays_the_cost_of_its_kind(block_times):
    model = tiny_model(num_layers=2)
    bare = Calibration(((1, 1.0), (2, 1.5)), float("inf"))
    # A pipeline's cost the same at any microbatch count here, so that every candidate keeps its microbatches.
    flat = {**COSTS, (1, 2, 8): COSTS[(1, 2, 2)], (1, 2, 8, 2): COSTS[(1, 2, 2)]}
    costed = Calibration(((1, 1.0), (2, 1.5)), float("inf"), step_costs=tuple(flat.items()))
    before = {r.name: r for r in rank_layouts(model, [2], 16, 10, CPU, bare, cores=2)}
    after = {r.name: r for r in rank_layouts(model, [2], 16, 10, CPU, costed, cores=2)}
    assert after.keys() == before.keys()
    for name, ranked in after.items():
        layout = ranked.layout
        expected = before[name].candidate.predicted_seconds + costed.step_cost(
            layout.data_parallel_size, layout.pipeline_parallel_size, layout.units, chunked=layout.time_chunks > 1)
        assert ranked.candidate.predicted_seconds == pytest.approx(expected), name


def test_step_costs_are_measured_once_per_machine_and_kept(tmp_path, monkeypatch, capsys):
    """The trial of 2 replicas also times their collectives (seconds per byte); a file kept before that is measured
    again for that trial only."""
    trials = []
    collectives = {(name, 2, 2): seconds for name, seconds in zip(step_cost.COLLECTIVES, (1e-9, 2e-9, 3e-9))}
    everything = {**COSTS, **collectives}

    def trial(*kind):
        trials.append(kind)
        if kind == (1, 2, 8) and len(trials) < 6:  # the first (1, 2, 8) fails
            return None
        return {kind: COSTS[kind], **(collectives if kind == (2, 1, 1) else {})}

    monkeypatch.setattr(step_cost, "CACHE_FILE", str(tmp_path / "costs.json"))
    monkeypatch.setattr(step_cost, "_run_trial", trial)
    assert step_cost.trial_kinds([2]) == [(1, 1, 1), (2, 1, 1), (1, 2, 2), (1, 2, 8), (1, 2, 8, 2)]
    assert step_cost.collective_keys(4) == [(name, 4, r) for r in (2, 4) for name in step_cost.COLLECTIVES]
    first = step_cost.step_costs([2])
    assert trials == step_cost.trial_kinds([2]) and (1, 2, 8) not in first and first[(2, 1, 1)] == 0.011
    assert first[("reduce_scatter", 2, 2)] == 3e-9
    assert "5 short runs of a near-zero model" in capsys.readouterr().out
    # The next run reads the file and measures only what failed.
    assert step_cost.step_costs([2]) == everything and trials[5:] == [(1, 2, 8)]
    assert step_cost.step_costs([2]) == everything and len(trials) == 6
    assert len(step_cost.step_costs([2], again=True)) == 8 and len(trials) == 11
    # A file kept before the collectives were timed: the replicas' trial runs again, nothing else.
    kept = json.loads((tmp_path / "costs.json").read_text())
    kept[step_cost._machine()] = {json.dumps(list(k)): v for k, v in COSTS.items()}
    (tmp_path / "costs.json").write_text(json.dumps(kept))
    assert step_cost.step_costs([2]) == everything and trials[11:] == [(2, 1, 1)]
    # A damaged file is said and measured again, never trusted: not JSON, not an object, this machine's entry bad.
    capsys.readouterr()
    for damaged, count in (("{not json", 17), ("[1, 2]", 22), (json.dumps({step_cost._machine(): ["x"]}), 27),
                           (json.dumps({step_cost._machine(): {"[1, 1, 1]": "fast"}}), 32)):
        (tmp_path / "costs.json").write_text(damaged)
        assert step_cost.step_costs([2]) == everything and len(trials) == count
        assert re.search(r"mp_lstm: the step costs kept in \S+costs\.json .*(unreadable|not a JSON object)",
                         capsys.readouterr().out), damaged


@pytest.mark.processes
def test_a_trial_runs_the_strategy_on_a_near_zero_model_and_reports_its_step():
    measured = step_cost._run_trial(1, 1, 1)
    assert measured is not None and list(measured) == [(1, 1, 1)] and 0 < measured[(1, 1, 1)] < 1


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_a_wavefront_trial_runs_two_stages_of_time_chunks():
    measured = step_cost._run_trial(1, 2, 8, 2)
    assert measured is not None and list(measured) == [(1, 2, 8, 2)] and 0 < measured[(1, 2, 8, 2)] < 1


def test_a_data_module_that_does_not_say_its_batch_shape_keeps_the_layout(compose_train, capsys):

    cfg = compose_train()
    strategy = build_strategy(cfg)
    model = build_model(cfg, strategy, 37)
    assert app_autopilot.choose_layout(cfg, strategy, model, SimpleNamespace(batch_size=32)) is None
    assert "the data module (SimpleNamespace) does not say its batch size" in capsys.readouterr().out


def test_the_calibration_measures_every_thread_count_a_candidate_runs_on_after_the_floor_is_read(block_times,
                                                                                                monkeypatch):
    """On 16 cores, 4 processes run 4 threads each: measured only at 1 and 16 threads, their speed-up was taken as
    one thread's, and every 4-process candidate was predicted 1.3-1.7x too slow (a lent machine, 2026-11-28)."""
    assert app_autopilot.candidate_threads(16, [1, 2, 4]) == [4, 8, 16]
    assert app_autopilot.candidate_threads(2, [1, 2]) == [1, 2]
    assert app_autopilot.candidate_threads(3, [2]) == [1, 3]
    asked, held = {}, [100]

    def calibrate(model, rows, length, device, threads=(), processes=(), **options):
        asked.update(threads=list(threads), processes=list(processes))
        held.append(10**9)  # what the timing runs leave in the heap
        return Calibration(tuple((t, float(t)) for t in {1, *threads}), float("inf"))

    def rank_layouts(*args, floor=0, **kwargs):
        asked["floor"] = floor
        return real_rank_layouts(*args, floor=floor, **kwargs)

    real_rank_layouts = app_autopilot.rank_layouts
    monkeypatch.setattr(app_autopilot, "calibrate", calibrate)
    monkeypatch.setattr(app_autopilot, "process_floor", lambda: held[-1])
    monkeypatch.setattr(app_autopilot, "rank_layouts", rank_layouts)
    monkeypatch.setattr(app_autopilot, "step_costs", lambda counts: {})
    monkeypatch.setattr(app_autopilot, "cpu_cores", lambda: 16)
    datamodule = SimpleNamespace(mean_padded_length=10, batch_size=32, bucket_lengths=[10])
    strategy = SimpleNamespace(memory_budget=lambda device, processes: (None, "no budget"),
                               may_shard=lambda precision: False)
    ranked, table = app_autopilot.rank_layouts_for(strategy, tiny_model(), datamodule, [2, 4])
    # The floor is what the process held before it timed anything.
    assert asked == {"threads": [4, 8, 16], "processes": [2, 4], "floor": 100}
    assert "dp4" in table and "on 16 cores" in table
    # What was calibrated is printed under the table, so that two rankings of a job can be compared.
    assert table.splitlines()[-1] == ("calibrated: 1 threads 1.00x, 4 threads 4.00x, 8 threads 8.00x, 16 threads "
                                      "16.00x; crowding not measured; transfer inf GB/s; first touch not measured")


@pytest.mark.processes
def test_a_trainer_script_gets_the_pick_and_its_devices_and_its_rank_processes_take_it_over(block_times, monkeypatch,
                                                                                             capsys):
    """``auto_strategy`` is ``layout=auto`` for a script that builds its own Trainer: the pick's strategy and process
    count; in a rank process the strategy started, the launching process's choice, with nothing timed."""
    from lightning_mp_lstm.data import LMDataModule
    from lightning_mp_lstm.strategy.launcher import CHECKED_BY
    from tests.helpers import quiet_trainer

    monkeypatch.delenv(app_autopilot.CHOICE, raising=False)
    monkeypatch.delenv(CHECKED_BY, raising=False)
    monkeypatch.setattr(app_autopilot, "step_costs", lambda counts: {})
    datamodule = LMDataModule(source="synthetic", batch_size=8, num_auto_buckets=2,
                              synthetic={"num_train": 64, "num_valid": 8, "num_test": 8, "vocab_size": 30})
    datamodule.setup("fit")
    model = tiny_model(vocab=datamodule.vocab_size)

    # Threads that scale perfectly: one process wins, and the Trainer it gets trains on one device.
    monkeypatch.setattr(app_autopilot, "calibrate", lambda *args, **kwargs: Calibration(
        ((1, 1.0), (2, 2.0)), float("inf"), crowding=((2, 1.5),)))
    strategy, devices = app_autopilot.auto_strategy(model, datamodule, processes=2, report_after_steps=None)
    assert devices == 1 and strategy.processes_for(model) == 1
    assert "1 process (2 threads)" in capsys.readouterr().out
    quiet_trainer(strategy, devices, max_steps=2, limit_val_batches=0).fit(model, datamodule=datamodule)
    strategy.shutdown()

    # No speed-up from threads: two processes win; a rank process of that job takes the choice over untimed.
    monkeypatch.setattr(app_autopilot, "calibrate", lambda *args, **kwargs: Calibration(((1, 1.0), (2, 1.0)),
                                                                                          float("inf")))
    strategy, devices = app_autopilot.auto_strategy(tiny_model(vocab=datamodule.vocab_size), datamodule, processes=2)
    choice = json.loads(os.environ[app_autopilot.CHOICE])
    assert devices == 2 == choice["data_parallel_size"] * choice["pipeline_parallel_size"]
    monkeypatch.setenv(CHECKED_BY, "1")
    monkeypatch.setattr(app_autopilot, "calibrate", lambda *args, **kwargs: pytest.fail("a rank process timed"))
    again, same = app_autopilot.auto_strategy(tiny_model(vocab=datamodule.vocab_size), datamodule, processes=2)
    assert same == devices and again.processes_for(model) == strategy.processes_for(model) == 2

    with pytest.raises(ValueError, match="got pipeline_parallel_size: pass the layout to MPLSTMStrategy"):
        app_autopilot.auto_strategy(model, datamodule, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="processes must be a positive number of processes or 'auto', got 0"):
        app_autopilot.auto_strategy(model, datamodule, processes=0)


def test_the_optimizer_timed_is_the_model_s_own_with_the_kernel_its_device_would_get():
    """A model on the meta device configures its optimizer without a kernel; on CPU its own would be fused (Adam's
    fused step took 19 ms over 16 M parameters where its loop took 85 ms): the maker adds it back."""
    meta = [torch.nn.Parameter(torch.empty(3, device="meta"))]
    configured = SimpleNamespace(configure_optimizers=lambda: {
        "optimizer": torch.optim.Adam(meta, lr=0.5, betas=(0.8, 0.9)), "lr_scheduler": None})
    make = app_autopilot.optimizer_maker(configured)
    made = make([torch.zeros(4, requires_grad=True)])
    assert type(made) is torch.optim.Adam and made.defaults["lr"] == 0.5 and made.defaults["betas"] == (0.8, 0.9)
    assert made.defaults["fused"] is True
    chosen = SimpleNamespace(configure_optimizers=lambda: ([torch.optim.SGD(meta, lr=1.0, foreach=False)], []))
    assert app_autopilot.optimizer_maker(chosen)([torch.zeros(4, requires_grad=True)]).defaults["fused"] is None

    def needs_a_trainer():
        raise RuntimeError("not attached to a Trainer")

    assert app_autopilot.optimizer_maker(SimpleNamespace(configure_optimizers=needs_a_trainer)) is None
    assert app_autopilot.optimizer_maker(SimpleNamespace(configure_optimizers=lambda: None)) is None

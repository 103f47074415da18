"""Layout advice: predicted step times of every way to use the devices, from block times and a calibration."""

from __future__ import annotations

import pytest
import torch

from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.planning import advice
from lightning_mp_lstm.planning.advice import advise, render
from lightning_mp_lstm.planning.calibration import LEAST_SECONDS, Calibration, calibrate, crowding, time_update
from lightning_mp_lstm.planning.plan import step_time
from tests.helpers import tiny_model

CPU = torch.device("cpu")


def _fake_times(monkeypatch, per_row: dict[str, float]) -> None:
    """Every block costs ``per_row[block] * rows`` seconds on one thread."""
    monkeypatch.setattr(advice.profile, "block_seconds",
                        lambda model, names, rows, *args, **kwargs: {n: per_row[n] * rows for n in names})


def test_predictions_follow_the_step_model_and_the_calibration(monkeypatch):
    per_row = {"embedding": 0.001, "lstm.0": 0.004, "lstm.1": 0.004, "decoder": 0.003}
    _fake_times(monkeypatch, per_row)
    model = tiny_model(num_layers=2)
    calibration = Calibration(thread_speedup=((1, 1.0), (2, 1.5)), bandwidth=float("inf"))
    candidates = advise(model, devices=2, batch_rows=16, length=10, device=CPU, calibration=calibration, cores=2)
    by_name = {c.name.split(",")[0]: c for c in candidates}
    one = by_name["1 process (2 threads)"]
    assert one.predicted_seconds == pytest.approx(sum(per_row.values()) * 16 / 1.5)
    assert by_name["dp2"].predicted_seconds == pytest.approx(sum(per_row.values()) * 8)  # 1 thread each, free comm
    pp2 = by_name["pp2 balanced"]
    rows = 16 // pp2.n_microbatches
    per_rank = [sum(per_row[b] * rows for b in stage) for stage in pp2.partition]
    assert pp2.predicted_seconds == pytest.approx(step_time(per_rank, pp2.n_microbatches))
    assert candidates == sorted(candidates, key=lambda c: c.predicted_seconds)
    assert render(candidates).splitlines()[-1] == f"expected fastest: {candidates[0].name}"


def test_a_perfect_thread_speedup_favours_one_process_and_none_favours_splitting(monkeypatch):
    _fake_times(monkeypatch, {"embedding": 0.001, "lstm.0": 0.004, "lstm.1": 0.004, "decoder": 0.003})
    model = tiny_model(num_layers=2)
    perfect = Calibration(((1, 1.0), (2, 2.0)), float("inf"))
    none = Calibration(((1, 1.0), (2, 1.0)), float("inf"))
    assert advise(model, 2, 16, 10, CPU, perfect, cores=2)[0].name == "1 process (2 threads)"
    assert advise(model, 2, 16, 10, CPU, none, cores=2)[0].name in ("dp2", "pp2 balanced, m=16")


def test_slow_links_make_data_parallelism_pay_for_its_gradients(monkeypatch):
    _fake_times(monkeypatch, {"embedding": 0.001, "lstm.0": 0.004, "lstm.1": 0.004, "decoder": 0.003})
    model = tiny_model(num_layers=2)
    fast = {c.name: c.predicted_seconds for c in advise(model, 2, 16, 10, CPU, Calibration(((1, 1.0),), 1e12))}
    slow = {c.name: c.predicted_seconds for c in advise(model, 2, 16, 10, CPU, Calibration(((1, 1.0),), 1e3))}
    parameters = sum(p.numel() for p in model.parameters())
    assert slow["dp2"] - fast["dp2"] == pytest.approx(4 * parameters / 1e3, rel=1e-6)  # one all-reduce


def test_replicas_pay_their_measured_collectives_and_every_process_its_optimizer_step(monkeypatch):
    """A copy's speed predicted gloo's 4-process all-reduce 8x too fast: replicas pay the collectives measured in
    groups of their size while all the layout's processes run (else measured alone, else a ring over the copy
    speed); and every process pays its optimizer step over the parameters it holds (its shard, sharded), slowed as
    its computation is (MXNet's 16 M parameters: 24 ms alone, 61 ms each in 4 processes on 2 cores)."""
    _fake_times(monkeypatch, {"embedding": 0.001, "lstm.0": 0.004, "lstm.1": 0.004, "decoder": 0.003})
    model = tiny_model(num_layers=2)
    counts = pipeline_model(model).analytic_costs("parameters", 1, 10)
    total = sum(counts.values())
    base = Calibration(((1, 1.0), (2, 1.0)), float("inf"), crowding=((2, 1.5), (4, 2.0)))
    charged = Calibration(((1, 1.0), (2, 1.0)), float("inf"), crowding=((2, 1.5), (4, 2.0)),
                          collectives=((("all_reduce", 2, 2), 2e-6), (("all_reduce", 4, 2), 1e-6),
                                       (("all_gather", 2, 2), 3e-6), (("reduce_scatter", 2, 2), 5e-6)),
                          update_seconds=((1, 1e-5), (2, 5e-6)))
    before = {c.name: c for c in advise(model, [2, 4], 16, 10, CPU, base, cores=2, time_chunks=())}
    after = {c.name: c for c in advise(model, [2, 4], 16, 10, CPU, charged, cores=2, time_chunks=())}
    assert after.keys() == before.keys()

    def added(name: str) -> float:
        return after[name].predicted_seconds - before[name].predicted_seconds

    assert added("1 process (2 threads)") == pytest.approx(total * 5e-6)
    assert added("dp2") == pytest.approx(total * 1e-5 * 1.5 + 4 * total * 2e-6)
    assert added("dp4") == pytest.approx(total * 1e-5 * 2.0)  # its all-reduce not measured: a ring, free here
    pipelined = next(name for name in after if name.startswith("dp2 x pp2 balanced"))
    stages = after[pipelined].partition
    assert added(pipelined) == pytest.approx(max(sum(counts[b] for b in stage) * (1e-5 * 2.0 + 4 * 1e-6)
                                                 for stage in stages))
    # Sharded: two gathers and one reduce-scatter as measured, the optimizer over half the parameters.
    sharded = advise(model, [2], 16, 10, CPU, charged, cores=2, sharded=True)[0]
    assert sharded.name == "dp2 sharded"
    assert sharded.predicted_seconds - before["dp2"].predicted_seconds == pytest.approx(
        total / 2 * 1e-5 * 1.5 + 4 * total * (2 * 3e-6 + 5e-6))
    assert charged.collective_seconds("all_reduce", 100, 2, 8) == pytest.approx(100 * 2e-6)  # measured alone
    assert Calibration(((1, 1.0),), 1e3).collective_seconds("all_gather", 1000, 4, 4) == pytest.approx(0.75)
    assert charged.update_cost(1000, 4, 1) == pytest.approx(1000 * 5e-6)  # the most threads measured below


def test_the_optimizer_step_is_timed_with_the_model_s_optimizer_and_its_clipping(monkeypatch):
    made, clipped = [], []

    def adam(tensors):
        made.append(sum(t.numel() for t in tensors))
        return torch.optim.Adam(tensors)

    clip = torch.nn.utils.clip_grad_norm_
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: clipped.append(1) or clip(*a, **k))
    seconds = time_update(adam, True, threads=1, parameters=2**16, repeats=2)
    assert made == [2**16] and len(clipped) == 3 and 0 < seconds < 1e-5
    assert time_update(None, False, threads=1, parameters=2**16, repeats=2) > 0 and len(clipped) == 3


def test_calibration_measures_a_speedup_for_every_thread_count():
    model = tiny_model(num_layers=1, hidden_size=32)
    calibration = calibrate(model, rows=4, length=8, device=CPU, threads=(1, 2), bandwidth=1e9)
    assert dict(calibration.thread_speedup)[1] == pytest.approx(1.0) and dict(calibration.thread_speedup)[2] > 0
    # Three threads do at least what the best of one or two did (a busy machine can make two slower than one).
    assert calibration.bandwidth == 1e9 and calibration.speedup(3) == max(1.0, dict(calibration.thread_speedup)[2])


@pytest.mark.parametrize("one_thread, rounds", [(1.0, 3), (0.1, 5), (1e-6, "most")])
def test_a_small_model_s_thread_calibration_runs_more_rounds(monkeypatch, one_thread, rounds):
    """At least three rounds, and more until one thread ran ``LEAST_SECONDS`` (at most ``MOST_REPEATS``)."""
    calls = []

    def timed(model, names, rows, length, device, **kwargs):
        calls.append(torch.get_num_threads())
        return {"only": one_thread if torch.get_num_threads() == 1 else one_thread / 2}

    monkeypatch.setattr(advice.profile, "block_seconds", timed)
    calibration = calibrate(tiny_model(num_layers=1, hidden_size=8), rows=2, length=4, device=CPU, threads=(1, 2),
                            bandwidth=1e9)
    expected = advice.profile.MOST_REPEATS if rounds == "most" else rounds
    assert LEAST_SECONDS == 0.5 and calls == [1, 2] * expected
    assert dict(calibration.thread_speedup)[2] == pytest.approx(2.0)


def test_processes_that_crowd_each_other_are_predicted_slower_by_the_measured_factor(monkeypatch):
    """Two processes on two cores share memory bandwidth and caches: each computes slower than one alone on one core,
    and the calibration's factor for two processes slows every two-process candidate by it, not one process."""
    per_row = {"embedding": 0.001, "lstm.0": 0.004, "lstm.1": 0.004, "decoder": 0.003}
    _fake_times(monkeypatch, per_row)
    model = tiny_model(num_layers=2)
    alone = Calibration(((1, 1.0), (2, 1.5)), float("inf"))
    crowded = Calibration(((1, 1.0), (2, 1.5)), float("inf"), crowding=((2, 1.8),))
    before = {c.name: c.predicted_seconds for c in advise(model, 2, 16, 10, CPU, alone, cores=2)}
    after = {c.name: c.predicted_seconds for c in advise(model, 2, 16, 10, CPU, crowded, cores=2)}
    assert after["1 process (2 threads)"] == pytest.approx(before["1 process (2 threads)"])
    assert after["dp2"] == pytest.approx(1.8 * before["dp2"])
    # A pipeline's ranks crowd each other only in its steady state, (m - 1) x max, and only as much as they are
    # busy in it: the busiest stage all the time, the other its share of that; its fill and drain run alone.
    pipelined = {c.name: c for c in advise(model, 2, 16, 10, CPU, crowded, cores=2, time_chunks=())}
    pp2 = next(c for name, c in pipelined.items() if name.startswith("pp2 balanced"))
    per_rank = [sum(per_row[b] * (16 // pp2.n_microbatches) for b in stage) for stage in pp2.partition]
    busy = sum(per_rank) / max(per_rank)
    assert 1 < busy < 2  # the blocks do not split evenly in two
    factor = 1 + 0.8 * (busy - 1)
    assert pp2.predicted_seconds == pytest.approx((pp2.n_microbatches - 1) * factor * max(per_rank) + sum(per_rank))
    assert crowded.slowdown(1) == 1.0 and crowded.slowdown(4) == 1.8 and alone.slowdown(2) == 1.0
    assert crowded.slowdown(1.5) == pytest.approx(1.4)  # a line between the measured counts
    both = Calibration(((1, 1.0),), float("inf"), crowding=((2, 1.2), (4, 2.0)))
    assert both.slowdown(3) == pytest.approx(1.6) and both.slowdown(8) == 2.0


def test_crowding_is_measured_as_at_least_one():
    factor = crowding(processes=2, threads=1, model=tiny_model(num_layers=1, hidden_size=16), rows=4,
                             length=8)
    assert factor >= 1.0 and factor < 20  # two workers on a busy 2-core box: slower, never faster
    calibration = calibrate(tiny_model(num_layers=1, hidden_size=16), rows=4, length=8, device=CPU, threads=(1,),
                            bandwidth=1e9, processes=(2,))
    assert [count for count, _ in calibration.crowding] == [2] and calibration.slowdown(2) >= 1.0


def test_a_pipeline_adds_up_each_microbatch_s_gradients_at_the_machine_s_copy_speed(monkeypatch):
    """Every microbatch's backward adds its gradients to those the parameters hold: 1.5x a copy of them per
    microbatch (a 50,000-word decoder in 16 microbatches spent about 0.4 s of a step on it)."""
    per_row = {"embedding": 0.001, "lstm.0": 0.004, "lstm.1": 0.004, "decoder": 0.003}
    _fake_times(monkeypatch, per_row)
    model = tiny_model(num_layers=2)
    bandwidth = 1e6
    (pp2,) = [c for c in advise(model, 2, 16, 10, CPU, Calibration(((1, 1.0),), bandwidth), cores=2, time_chunks=())
              if c.name.startswith("pp2")]
    blocks = pipeline_model(model)
    parameters = blocks.analytic_costs("parameters", 1, 10)
    rows = 16 // pp2.n_microbatches
    transfer = 2 * advice._block_bytes(blocks, pp2.partition[1][0], rows, 10) / bandwidth
    per_rank = [sum(per_row[b] * rows for b in stage) + 3 * sum(parameters[b] for b in stage) / bandwidth + transfer
                for stage in pp2.partition]
    assert pp2.predicted_seconds == pytest.approx(step_time(per_rank, pp2.n_microbatches))


def test_a_backward_fills_each_gradient_above_the_mmap_threshold_afresh_every_microbatch(monkeypatch):
    """A gradient too large for glibc to keep in its heap is new memory at every backward: one process and replicas
    fill it once a step, a pipeline's stage once per microbatch, at the measured first-touch speed; sharded replicas
    pay it in their collectives' buffers, and an unmeasured speed charges nothing."""
    per_row = {"embedding": 0.001, "lstm.0": 0.004, "lstm.1": 0.004, "decoder": 0.003}
    _fake_times(monkeypatch, per_row)
    model = tiny_model(num_layers=2)
    threshold = 4 * 6 * 8  # bytes: the embedding's and the decoder's weights are above it, the LSTM's too
    monkeypatch.setattr(advice, "STEADY_MMAP_THRESHOLD", threshold)
    fresh = advice.fresh_gradient_bytes(pipeline_model(model), pipeline_model(model).block_names)
    large = {name: sum(4 * p.numel() for p in block.parameters() if 4 * p.numel() >= threshold)
             for name, block in pipeline_model(model).blocks()}
    assert fresh == large and 0 < fresh["embedding"] < sum(4 * p.numel() for p in model.parameters())
    touch = 1e6
    plain = Calibration(((1, 1.0), (2, 1.0)), float("inf"))
    measured = Calibration(((1, 1.0), (2, 1.0)), float("inf"), first_touch=touch)
    before = {c.name: c for c in advise(model, 2, 16, 10, CPU, plain, cores=2, time_chunks=())}
    after = {c.name: c for c in advise(model, 2, 16, 10, CPU, measured, cores=2, time_chunks=())}
    everything = sum(fresh.values()) / touch
    assert after["1 process (2 threads)"].predicted_seconds - before["1 process (2 threads)"].predicted_seconds == (
        pytest.approx(everything))
    assert after["dp2"].predicted_seconds - before["dp2"].predicted_seconds == pytest.approx(everything)
    pp2 = next(c for name, c in after.items() if name.startswith("pp2"))
    rows = 16 // pp2.n_microbatches
    per_rank = [sum(per_row[b] * rows for b in stage) + sum(fresh[b] for b in stage) / touch
                for stage in pp2.partition]
    assert pp2.predicted_seconds == pytest.approx(step_time(per_rank, pp2.n_microbatches))
    sharded = [advise(model, 2, 16, 10, CPU, c, cores=2, sharded=True)[0] for c in (plain, measured)]
    assert sharded[0].name == "dp2 sharded" and sharded[1].predicted_seconds > sharded[0].predicted_seconds
    assert sharded[1].predicted_seconds - sharded[0].predicted_seconds == pytest.approx(
        advice.shard_seconds(4 * sum(pipeline_model(model).analytic_costs("parameters", 1, 10).values()), 2, 2,
                             measured) - advice.shard_seconds(
            4 * sum(pipeline_model(model).analytic_costs("parameters", 1, 10).values()), 2, 2, plain))


def test_crowding_is_the_median_of_its_rounds(monkeypatch):
    """Each round times one worker alone, then all at once; one round's ratio swung 1.00-1.11 for two workers."""
    import threading

    from lightning_mp_lstm.planning import calibration

    crowded_in_round = iter([1.0, 3.0, 1.5])
    state = {"factor": 1.0}

    def chain(blocks, rows, length):
        if threading.current_thread() is threading.main_thread():
            state["factor"] = next(crowded_in_round)
            return 0.01
        return 0.01 * state["factor"]

    monkeypatch.setattr(calibration, "_chain_seconds", chain)
    assert calibration.CROWDING_ROUNDS == 3
    assert crowding(processes=2, threads=1, model=tiny_model(num_layers=1), rows=4, length=8) == pytest.approx(1.5)


def test_the_copy_speed_is_timed_between_buffers_already_held(monkeypatch):
    """A copy into memory mapped afresh pays its page faults: the calibration's bandwidth is a copy between two filled
    buffers (halved for the transport), not the first copy into a new one."""
    from lightning_mp_lstm.planning import calibration

    copies = []
    real_copy = torch.Tensor.copy_

    def recorded(target, source, *args, **kwargs):
        copies.append((int(target.min()), int(source.min())))
        return real_copy(target, source, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", recorded)
    speed = calibration.copy_bandwidth(nbytes=2**20, repeats=3)
    assert speed > 0 and len(copies) == 3
    assert copies[0] == (1, 1)  # both written before the first timed copy (untouched memory reads as zeros)
    monkeypatch.setattr(calibration, "copy_bandwidth", lambda: 8e9)
    result = calibrate(tiny_model(num_layers=1, hidden_size=8), rows=2, length=4, device=CPU, threads=(1,))
    assert result.bandwidth == 4e9


def test_the_calibration_summary_names_every_measured_term():
    calibration = Calibration(((1, 1.0), (2, 1.5)), 2e9, crowding=((2, 1.13),), first_touch=1.2e9,
                              update_seconds=((1, 2.5e-9),))
    assert calibration.summary() == ("1 threads 1.00x, 2 threads 1.50x; crowding 2 at once 1.13x; transfer 2.0 GB/s; "
                                     "first touch 1.2 GB/s; optimizer 2.5 ms per M parameters on 1")

"""``lightning_mp_lstm.base.testing.run_ranks``: both start methods give every rank the launcher's environment and the
caller's, a deadline kills the ranks, and a bad start method is refused before any process starts."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lightning_mp_lstm.base import testing
from tests.helpers import run_ranks


def _environment(rank: int, world_size: int, name: str) -> dict:
    import torch

    return {"rank": rank, "RANK": os.environ["RANK"], "WORLD_SIZE": os.environ["WORLD_SIZE"],
            "value": os.environ.get(name), "threads": torch.get_num_threads(), "pid": os.getpid()}


def _sleep(rank: int, world_size: int, directory: str) -> None:
    Path(directory, f"rank{rank}.pid").write_text(str(os.getpid()))
    time.sleep(60)


@pytest.mark.parametrize("start_method", testing.START_METHODS)
@pytest.mark.processes
def test_every_rank_sees_the_launch_variables_and_the_callers_environment_at_the_call(start_method, monkeypatch):
    if start_method == "forkserver":
        run_ranks(_environment, 1, "UNSET")  # the server is running (and has its environment) from here on
    monkeypatch.setenv("MP_LSTM_PROBE", f"set after the first call ({start_method})")
    results = testing.run_ranks(_environment, 2, "MP_LSTM_PROBE", start_method=start_method, timeout=60)
    assert [(r["rank"], r["RANK"], r["WORLD_SIZE"]) for r in results] == [(0, "0", "2"), (1, "1", "2")]
    assert {r["value"] for r in results} == {f"set after the first call ({start_method})"}
    assert {r["threads"] for r in results} == {1}
    assert len({r["pid"] for r in results} | {os.getpid()}) == 3


@pytest.mark.processes
def test_ranks_past_the_deadline_are_killed(tmp_path):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="2 ranks of _sleep did not finish in 3 s"):
        run_ranks(_sleep, 2, str(tmp_path), timeout=3)
    assert time.monotonic() - started < 30
    pids = [int((tmp_path / f"rank{rank}.pid").read_text()) for rank in range(2)]
    deadline = time.monotonic() + 10
    while any(_running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_running(pid) for pid in pids)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_an_unknown_start_method_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match=r"start_method='fork'; allowed: spawn, forkserver"):
        testing.run_ranks(_environment, 2, "X", start_method="fork")


def test_the_fast_tier_refuses_a_process_start_from_an_unmarked_test(request, monkeypatch):
    """``-m "not processes"`` starts no process: an unmarked test (this one) that starts one fails, naming itself,
    whether through ``subprocess`` or ``multiprocessing``."""
    import multiprocessing
    import multiprocessing.process
    import subprocess

    from tests import conftest

    # Put back whatever is there now (the guard is installed only in the fast tier) once the test ends.
    monkeypatch.setattr(subprocess.Popen, "__init__", subprocess.Popen.__init__)
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", multiprocessing.process.BaseProcess.start)
    monkeypatch.setitem(conftest._RUNNING, "item", request.node)
    conftest._refuse_unmarked_process_starts()
    unmarked = r"test_the_fast_tier_refuses_a_process_start_from_an_unmarked_test starts {} but is not marked " \
               r"@pytest.mark.processes"
    with pytest.raises(RuntimeError, match=unmarked.format(r"a process \(\['true'\]\)")):
        subprocess.run(["true"])
    with pytest.raises(RuntimeError, match=unmarked.format("a multiprocessing process")):
        multiprocessing.get_context("spawn").Process(target=print).start()

"""A crashed rank ends the whole run within the strategy's timeout; registering the strategy is idempotent."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
import time
import warnings
from datetime import timedelta
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry

import lightning_mp_lstm
from lightning_mp_lstm import LSTMLanguageModel, MPLSTMStrategy
from tests.helpers import VOCAB, DictStore, FixedBatches, run_ranks

TIMEOUT = 8.0  # the strategy's process-group timeout, seconds
CRASHED_RANK, CRASH_BATCH = 1, 2
LINGER = 4 * TIMEOUT  # the crashed rank stays alive (stuck, not exited) at most this long


class CrashOnOneRank(pl.Callback):
    def on_fit_start(self, trainer, pl_module) -> None:
        mesh = trainer.strategy.device_mesh
        self.group_timeouts = {
            name: mesh[name].get_group()._get_backend(torch.device("cpu")).options._timeout.total_seconds()
            for name in ("data_parallel", "pipeline_parallel")
        }

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == CRASH_BATCH and trainer.global_rank == CRASHED_RANK:
            self.crashed_at = time.time()
            raise RuntimeError(f"simulated failure on rank {CRASHED_RANK} at batch {batch_idx}")


def _crash_worker(rank: int, world_size: int, flags: str) -> dict:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = LSTMLanguageModel(VOCAB, embedding_dim=6, hidden_size=8, num_layers=2)
    callback = CrashOnOneRank()
    strategy = MPLSTMStrategy(data_parallel_size=2, schedule="GPipe", n_microbatches=2, timeout=TIMEOUT,
                              report_after_steps=None)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=6, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=[callback])
    out = {"error": None, "message": ""}
    try:
        trainer.fit(model, datamodule=FixedBatches())
    except Exception as err:  # noqa: BLE001  (reported to the parent)
        out.update(error=type(err).__name__, message=str(err)[:1000])
    out.update(ended_at=time.time(), steps=trainer.global_step, group_timeouts=callback.group_timeouts,
               crashed_at=getattr(callback, "crashed_at", None))
    Path(flags, f"done{rank}").touch()
    if rank == CRASHED_RANK:
        # A failed rank that does not exit (stuck in user code, a debugger, a hung data worker): its peers
        # must give up by themselves after the timeout. Stay until they did, at most LINGER seconds.
        deadline = time.monotonic() + LINGER
        while time.monotonic() < deadline and len(os.listdir(flags)) < world_size:
            time.sleep(0.1)
    return out


@pytest.mark.timeout(150)
@pytest.mark.processes
def test_a_crashed_rank_ends_every_rank_within_the_timeout(tmp_path):
    # Spawned, not forked: a spawned rank ends through interpreter shutdown as a launched rank does, a forked one at
    # once, and the order in which the survivors see rank 0 (the store's host) go is what this test is about.
    results = run_ranks(_crash_worker, 4, str(tmp_path), timeout=120, start_method="spawn")
    crashed = results[CRASHED_RANK]
    assert crashed["error"] == "RuntimeError"
    assert crashed["message"] == f"simulated failure on rank {CRASHED_RANK} at batch {CRASH_BATCH}"
    assert crashed["steps"] == CRASH_BATCH
    for rank, result in enumerate(results):
        # Every sub-group of the mesh (not only the default group) has the strategy's timeout.
        assert result["group_timeouts"] == {"data_parallel": TIMEOUT, "pipeline_parallel": TIMEOUT}, rank
        if rank == CRASHED_RANK:
            continue
        # The pipeline peer (rank 0) and the other replica (ranks 2, 3: blocked in the gradient all-reduce
        # and in their own pipeline) all fail with a gloo error instead of waiting for the stuck rank.
        assert result["error"] == "RuntimeError", (rank, result)
        # ...and each names the rank that failed, and why, not only the transport's message.
        assert result["message"].startswith(f"mp_lstm: rank {rank} stopped because it lost a peer: rank 1 (pid "), rank
        assert "failed with RuntimeError: simulated failure on rank 1 at batch 2" in result["message"], rank
        assert "Timed out" in result["message"] or "Connection closed by peer" in result["message"], (rank, result)
        assert result["steps"] <= CRASH_BATCH
        waited = result["ended_at"] - crashed["crashed_at"]
        assert waited < TIMEOUT + 10, (rank, waited)


@pytest.mark.timeout(60)
def test_strategy_name_and_a_second_import_are_harmless():
    warnings.filterwarnings("ignore")

    def build(devices: int = 2) -> pl.Trainer:
        return pl.Trainer(strategy="mp_lstm", accelerator="cpu", devices=devices, logger=False,
                          enable_progress_bar=False, enable_model_summary=False)

    entry = dict(StrategyRegistry["mp_lstm"])
    for _ in range(2):
        importlib.reload(lightning_mp_lstm)
    assert list(StrategyRegistry).count("mp_lstm") == 1 and dict(StrategyRegistry["mp_lstm"]) == entry
    assert lightning_mp_lstm.MPLSTMStrategy is MPLSTMStrategy
    trainer = build()
    assert type(trainer.strategy) is MPLSTMStrategy
    assert trainer.strategy.layout.pipeline_parallel_size == 2 and trainer.strategy.layout.data_parallel_size == 1
    assert build(devices=1).strategy.layout.pipeline_parallel_size == 1
    # Reloading the strategy module itself (e.g. IPython autoreload) re-creates the class: the name must
    # then give the new class, not the stale one.
    module = importlib.import_module("lightning_mp_lstm.strategy.strategy")
    try:
        importlib.reload(module)
        importlib.reload(lightning_mp_lstm)
        assert module.MPLSTMStrategy is not MPLSTMStrategy
        assert type(build().strategy) is module.MPLSTMStrategy is lightning_mp_lstm.MPLSTMStrategy
    finally:  # leave the original class everywhere, for the other tests of this session
        module.MPLSTMStrategy = lightning_mp_lstm.MPLSTMStrategy = MPLSTMStrategy
        MPLSTMStrategy.register_strategies(StrategyRegistry)
    assert type(build().strategy) is MPLSTMStrategy
    assert isinstance(MPLSTMStrategy(timeout=3)._run.process.timeout, timedelta)


def _ended_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


@pytest.mark.processes
def test_a_rank_that_only_lost_a_peer_is_not_named_as_the_cause(monkeypatch):
    """Rank 2 ended after naming its own loss; rank 1 was killed. Rank 0 names rank 1 only, and rank 3 (which
    reported its own error) with its message."""
    from lightning_mp_lstm.base import faults

    store = DictStore()
    monkeypatch.setattr(faults.PeerDirectory, "_store", staticmethod(lambda: store))
    host = socket.gethostname()
    peers = [faults._Peer(0, host, os.getpid()), faults._Peer(1, host, _ended_pid()),
             faults._Peer(2, host, _ended_pid()), faults._Peer(3, host, os.getpid())]
    faults.PeerDirectory(peers, 2).explain(RuntimeError("Connection closed by peer [127.0.0.1]:1"))
    faults.PeerDirectory(peers, 3).explain(ValueError("bad batch"))
    error = RuntimeError("Connection closed by peer [127.0.0.1]:2")
    faults.PeerDirectory(peers, 0).explain(error)
    where = f"rank 1 (pid {peers[1].pid} on {host})"
    assert str(error).startswith(f"mp_lstm: rank 0 stopped because it lost a peer: {where} is no longer running "
                                 f"(killed or crashed); rank 3 (pid {os.getpid()} on {host}) failed with "
                                 "ValueError: bad batch. Transport error: Connection closed by peer")
    assert "rank 2" not in str(error)
    assert store.values["mp_lstm/lost_peer/2"].decode().startswith(f"{where} is no longer running")

"""Failures off the happy path: an error on one rank reaches every rank, a killed rank is named by the others
and leaves no process behind, a non-finite loss stops training where it started, dropout draws independent
masks per stage and replica, a rank killed while saving leaves the previous checkpoint usable, no checkpoint
mixes two steps, and a port another run holds is refused by name."""

from __future__ import annotations

import hashlib
import io
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import lightning as lightning_environment
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm import checkpoint as checkpoint_module
from lightning_mp_lstm.app.training import train
from lightning_mp_lstm.checkpoint import CheckpointError, read_checkpoint
from lightning_mp_lstm.planning import profile
from lightning_mp_lstm.strategy.launcher import PortInUseError
from tests.helpers import (
    ONE_PROCESS,
    RELIABILITY_MESSAGES,
    SMALL_SYNTHETIC,
    TINY_RUN,
    FixedBatches,
    assert_ranks_match,
    free_port,
    parameters_of,
    processes_in_group,
    quiet_trainer,
    run_ranks,
    start_command,
    tiny_model,
)

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes

TIMEOUT = 8.0  # the strategy's process-group timeout in these tests, seconds


def _strategy(**kwargs) -> MPLSTMStrategy:
    return MPLSTMStrategy(**{"n_microbatches": 2, "report_after_steps": None, "timeout": TIMEOUT, **kwargs})


def _outcome(fit) -> dict:
    started = time.monotonic()
    try:
        fit()
        return {"error": None, "message": "", "seconds": time.monotonic() - started}
    except Exception as error:  # noqa: BLE001  (reported to the test process)
        return {"error": type(error).__name__, "message": str(error), "seconds": time.monotonic() - started,
                "group_initialized": dist.is_initialized()}


# ----- errors raised on one rank ---------------------------------------------------------------------------
def _failing_plan_worker(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    if rank == 0:  # profiling fails on the rank that plans; the others only wait for the plan
        def broken(*args, **kwargs):
            raise ValueError("profiling failed on purpose")

        profile.block_seconds = broken
    strategy = MPLSTMStrategy(partition="balanced", n_microbatches=2, timeout=60, report_after_steps=None)
    trainer = quiet_trainer(strategy, world_size, max_steps=1)
    return _outcome(lambda: trainer.fit(tiny_model(), datamodule=FixedBatches()))


@pytest.mark.timeout(120)
def test_an_error_in_rank_zero_planning_reaches_every_rank_at_once():
    results = run_ranks(_failing_plan_worker, 2, timeout=100)
    for rank, result in enumerate(results):
        assert result["error"] == "ValueError" and result["message"] == "profiling failed on purpose", rank
        assert result["seconds"] < 15, rank  # not the 60 s process-group timeout


def _bad_setting_worker(rank: int, world_size: int) -> list[dict]:
    warnings.filterwarnings("ignore")
    cases = [
        (dict(partition="balanced", stage_speeds=[1.0, 2.0, 3.0]), 2, FixedBatches()),
        (dict(partition="balanced", stages_per_rank=2, schedule="Interleaved1F1B"), 1, FixedBatches()),
        (dict(n_microbatches="auto", schedule="1F1B"), 2, FixedBatches(rows=1)),
    ]
    outcomes = []
    for kwargs, layers, data in cases:
        trainer = quiet_trainer(_strategy(**kwargs), world_size, max_steps=1)
        outcomes.append(_outcome(lambda: trainer.fit(tiny_model(num_layers=layers), datamodule=data)))
    return outcomes


@pytest.mark.timeout(120)
def test_settings_that_need_the_model_fail_on_every_rank_before_the_first_collective():
    results = run_ranks(_bad_setting_worker, 2, timeout=100)
    assert results[0] == [{**r, "seconds": results[0][i]["seconds"]} for i, r in enumerate(results[1])]
    speeds, too_many, no_count = results[0]
    assert speeds["error"] == "PartitionError"
    assert speeds["message"].startswith("stage_speeds has 3 values but the layout has 2 stages")
    assert too_many["error"] == "PartitionError"
    assert "the layout has 4 pipeline stages" in too_many["message"] and "the model has 3 blocks" in too_many["message"]
    assert no_count["error"] == "LayoutError"
    assert "n_microbatches='auto' found no count" in no_count["message"]
    assert "per-replica batch of 1 sentences" in no_count["message"]
    for outcome in results[0] + results[1]:
        assert outcome["group_initialized"] is False  # raised before the process group (the first collective)


# ----- a rank killed in the middle of a step ---------------------------------------------------------------
class _KillInsideTheDecoder(pl.Callback):
    """SIGKILLs global rank 1 inside its decoder's forward pass at batch 2 (in the middle of the schedule)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 2 and trainer.global_rank == 1:
            def die(module, inputs, output):
                Path(self.marker).write_text(str(time.time()))
                os.kill(os.getpid(), signal.SIGKILL)

            pl_module.decoder.register_forward_hook(die)


def _killed_rank_worker(rank: int, world_size: int, marker: str) -> dict:
    warnings.filterwarnings("ignore")
    trainer = quiet_trainer(_strategy(data_parallel_size=2, schedule="GPipe"), world_size, max_steps=6,
                            callbacks=[_KillInsideTheDecoder(marker)])
    outcome = _outcome(lambda: trainer.fit(tiny_model(), datamodule=FixedBatches()))
    return {**outcome, "ended_at": time.time(), "pid": os.getpid()}


@pytest.mark.timeout(150)
def test_a_rank_killed_mid_step_is_named_by_every_other_rank(tmp_path):
    marker = tmp_path / "killed_at"
    # Spawned, not forked: how fast rank 0 (the store's host) ends decides what the others can still read; a spawned
    # rank ends through interpreter shutdown as a launched rank does, a forked one at once.
    results = run_ranks(_killed_rank_worker, 4, str(marker), timeout=TIMEOUT + 90, allow_missing=True,
                        start_method="spawn")
    assert results[1] is None  # killed: no result
    killed_at = float(marker.read_text())
    for rank in (0, 2, 3):
        result = results[rank]
        assert result["error"] == "RuntimeError", (rank, result)
        assert re.search(r"lost a peer: rank 1 \(pid \d+ on [^)]+\) is no longer running", result["message"]), result
        assert result["ended_at"] - killed_at < TIMEOUT + 5, (rank, result["ended_at"] - killed_at)


def _read_lines(proc, lines: list[str]) -> threading.Thread:
    def pump() -> None:
        for line in proc.stdout:
            lines.append(line)

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


@pytest.mark.timeout(200)
@pytest.mark.parametrize("victim", ["launcher (rank 0)", "spawned rank 1"])
def test_killing_a_rank_of_train_py_ends_the_run_and_leaves_no_process(tmp_path, victim):
    args = [sys.executable, "train.py", "layout=pp2", "trainer=ci", "trainer.limit_train_batches=null",
            "trainer.max_epochs=100", "data.synthetic.num_train=2000", "model.hidden_size=16",
            "model.embedding_dim=16", f"hydra.run.dir={tmp_path}/run"]
    proc = start_command(args)
    lines: list[str] = []
    reader = _read_lines(proc, lines)
    try:
        assert _wait_for(lambda: any("partition (costs by" in line for line in lines), 120), "".join(lines)[-3000:]
        time.sleep(2.0)  # into the training steps
        ranks = sorted(processes_in_group(proc.pid))
        assert len(ranks) == 2 and proc.pid in ranks, ranks
        target = proc.pid if victim.startswith("launcher") else next(p for p in ranks if p != proc.pid)
        os.kill(target, signal.SIGKILL)
        killed_at = time.monotonic()
        gone = _wait_for(lambda: not processes_in_group(proc.pid), 30)
        assert gone, f"processes left: {processes_in_group(proc.pid)}"
        ended_in = time.monotonic() - killed_at
    finally:
        for pid in processes_in_group(proc.pid):
            os.kill(pid, signal.SIGKILL)
    reader.join(timeout=10)
    output = "".join(lines)
    assert proc.wait(timeout=10) != 0
    # No native stack dump (torch's store client, asked after its server on rank 0 is gone) before the message.
    assert "frame #" not in output and "Exception raised from" not in output, output[-5000:]
    if victim.startswith("launcher"):
        # The spawned rank notices at once (its socket closes), names rank 0 and exits by itself.
        assert re.search(RELIABILITY_MESSAGES["rank 0 killed"], output), output[-3000:]
    else:
        # Lightning's launcher watches its children: it names rank 1's death and ends the run.
        assert f"[rank: 1] Child process with PID {target} terminated with code -9" in output, output[-3000:]
    assert ended_in < 20


# ----- non-finite loss -------------------------------------------------------------------------------------
class _PoisonLayer(pl.Callback):
    """At batch 2, the rank that holds ``lstm.1`` puts an infinity into its recurrent weights."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if batch_idx == 2 and pl_module.lstm[1] is not None:  # the pruned model keeps only its own layers
            with torch.no_grad():
                pl_module.lstm[1].weight_hh_l0[0, 0] = float("inf")


def _non_finite_worker(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore")
    model = tiny_model(num_layers=2)
    trainer = quiet_trainer(_strategy(), world_size, max_steps=6, callbacks=[_PoisonLayer()])
    outcome = _outcome(lambda: trainer.fit(model, datamodule=FixedBatches()))
    return {**outcome, "global_step": trainer.global_step}


@pytest.mark.timeout(120)
def test_a_non_finite_loss_stops_every_rank_naming_the_step_and_the_block():
    results = run_ranks(_non_finite_worker, 2, timeout=100)
    assert results[0]["message"] == results[1]["message"]
    for result in results:
        assert result["error"] == "FloatingPointError", result
        expected = r"mp_lstm: the training loss is nan at global step 2 \(epoch 0, batch_idx 2\)"
        assert re.match(expected, result["message"]), result["message"]
        assert "came from block lstm.1 (stage 1, pipeline rank 1, replica 0)" in result["message"], result
        assert result["global_step"] == 2  # no optimizer step with the poisoned batch


# ----- dropout ---------------------------------------------------------------------------------------------
class _MaskRecorder(pl.Callback):
    """Hash of the zero pattern each dropout draws in training, in order, per block (shape-inference passes of
    torch's pipelining, on uninitialized tensors, left out). The model's blocks share one dropout module: the block
    running is noted as each block starts."""

    def __init__(self) -> None:
        self.masks: dict[str, list[str]] = {}

    def on_fit_start(self, trainer, pl_module) -> None:
        stages = list(trainer.strategy.engine.stage_modules.values())
        running: dict[str, str] = {}
        for stage in stages:
            for name, block in zip(stage.block_names, stage.blocks, strict=True):
                block.register_forward_pre_hook(lambda module, args, name=name: running.update(block=name))

        def record(module, inputs, output):
            if module.training and not any(stage.inferring_shapes for stage in stages):
                pattern = (output == 0) & (inputs[0] != 0)
                digest = hashlib.sha1(pattern.numpy().tobytes()).hexdigest()[:12]
                self.masks.setdefault(running["block"], []).append(digest)

        dropouts = {id(m): m for stage in stages for m in stage.modules() if isinstance(m, torch.nn.Dropout)}
        for module in dropouts.values():
            module.register_forward_hook(record)


def _dropout_worker(rank: int, world_size: int, kwargs: dict, seed: int) -> dict:
    warnings.filterwarnings("ignore")
    pl.seed_everything(seed, verbose=False)
    model = tiny_model(num_layers=2, embedding_dim=8, hidden_size=8, dropout=0.5)
    recorder = _MaskRecorder()
    trainer = quiet_trainer(_strategy(**kwargs), world_size, max_steps=2, callbacks=[recorder])
    trainer.fit(model, datamodule=FixedBatches())
    return recorder.masks


@pytest.mark.timeout(200)
def test_dropout_masks_are_independent_per_stage_and_replica_and_repeat_per_seed():
    pp2 = run_ranks(_dropout_worker, 2, {}, 7, timeout=100)
    # The first mask each pipeline rank draws (same shape: embedding and hidden are both 8 wide).
    assert len(pp2[0]["embedding"]) == len(pp2[1]["lstm.1"]) == 4  # 2 steps x 2 microbatches
    assert pp2[0]["embedding"][0] != pp2[1]["lstm.1"][0]
    assert len(set(pp2[0]["embedding"] + pp2[0]["lstm.0"] + pp2[1]["lstm.1"])) == 3 * len(pp2[0]["embedding"])
    again = run_ranks(_dropout_worker, 2, {}, 7, timeout=100)
    assert again == pp2  # the same seed draws the same masks
    other_seed = run_ranks(_dropout_worker, 2, {}, 8, timeout=100)
    assert other_seed[0]["embedding"] != pp2[0]["embedding"]
    dp2 = run_ranks(_dropout_worker, 2, {"data_parallel_size": 2, "n_microbatches": 1}, 7, timeout=100)
    for block in ("embedding", "lstm.0", "lstm.1"):  # the same stage on two replicas: different masks
        assert set(dp2[0][block]).isdisjoint(dp2[1][block]), block


# ----- a rank killed while saving --------------------------------------------------------------------------
EPOCH_BATCHES = 3


def _save_kill_worker(rank: int, world_size: int, directory: str) -> dict:
    warnings.filterwarnings("ignore")
    writes = []
    if rank == 0:  # the writer dies by SIGKILL half-way through its second checkpoint file
        original = checkpoint_module._serialize

        def serialize(checkpoint, handle):
            writes.append(handle.name)
            if len(writes) < 2:
                return original(checkpoint, handle)
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            handle.write(buffer.getvalue()[: buffer.tell() // 2])
            handle.flush()
            os.kill(os.getpid(), signal.SIGKILL)

        checkpoint_module._serialize = serialize
    save = ModelCheckpoint(dirpath=directory, filename="last", save_top_k=-1, every_n_epochs=1,
                           enable_version_counter=False)
    model = tiny_model(optimizer="adam", lr=0.01)
    trainer = quiet_trainer(_strategy(), world_size, max_epochs=3, callbacks=[save])
    return _outcome(lambda: trainer.fit(model, datamodule=FixedBatches((5, 9, 7))))


def _one_process_fit(max_epochs: int, ckpt_path=None) -> dict:
    warnings.filterwarnings("ignore")
    model = tiny_model(optimizer="adam", lr=0.01)
    trainer = quiet_trainer("auto", 1, max_epochs=max_epochs)
    trainer.fit(model, datamodule=FixedBatches((5, 9, 7)), ckpt_path=ckpt_path)
    return {"params": parameters_of(model), "global_step": trainer.global_step}


@pytest.mark.timeout(200)
def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_to_resume_from(tmp_path):
    results = run_ranks(_save_kill_worker, 2, str(tmp_path), timeout=TIMEOUT + 90, allow_missing=True)
    assert results[0] is None  # killed while writing epoch 1's checkpoint
    assert re.search(r"lost a peer: rank 0 \(pid \d+ on [^)]+\) is no longer running", results[1]["message"])
    leftovers = sorted(p.name for p in tmp_path.iterdir())
    assert leftovers[0].startswith(".last.ckpt.tmp-") and leftovers[1:] == ["last.ckpt"], leftovers
    checkpoint = read_checkpoint(tmp_path / "last.ckpt")  # epoch 0's file, whole
    assert checkpoint["global_step"] == EPOCH_BATCHES and checkpoint["epoch"] == 0
    # Resuming from it continues exactly: equal to an uninterrupted run of the same length.
    resumed = _one_process_fit(3, ckpt_path=tmp_path / "last.ckpt")
    uninterrupted = _one_process_fit(3)
    assert resumed["global_step"] == uninterrupted["global_step"] == 3 * EPOCH_BATCHES
    assert_ranks_match([resumed["params"]], uninterrupted["params"])


class _FailsOnOneRank(pl.Callback):
    """Raises on global rank 1 before its optimizer step of global step 2: that rank keeps its blocks as of step 1
    while rank 0 finishes step 2 (and waits in step 3 until the strategy's timeout)."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_rank == 1 and trainer.global_step == 2:
            raise ValueError("boom on rank 1 at global step 2")


def _mid_step_save_worker(rank: int, world_size: int, directory: str) -> dict:
    warnings.filterwarnings("ignore")
    saved = OnExceptionCheckpoint(directory, filename="on_error")
    trainer = quiet_trainer(_strategy(), world_size, max_epochs=2, callbacks=[_FailsOnOneRank(), saved],
                            enable_checkpointing=True, default_root_dir=directory)
    outcome = _outcome(lambda: trainer.fit(tiny_model(), datamodule=FixedBatches()))
    return {**outcome, "global_step": trainer.global_step}


@pytest.mark.timeout(200)
def test_a_rank_that_failed_mid_step_leaves_no_checkpoint_mixing_two_steps(tmp_path):
    """``OnExceptionCheckpoint`` saves after one rank raised mid-step, when the other rank had taken one more step: the
    file gathered from both held two steps' weights under rank 0's step count (written before this check). The
    peers' process group may be broken by then (the waiting rank timed out), so what each rank raises is either the
    check's message or the lost connection; either way nothing is written."""
    results = run_ranks(_mid_step_save_worker, 2, str(tmp_path), timeout=TIMEOUT + 90)
    assert [r["global_step"] for r in results] == [3, 2]
    assert all(r["error"] is not None for r in results), results
    assert list(tmp_path.iterdir()) == []


def _save_at_steps_worker(rank: int, world_size: int, directory: str) -> str:
    warnings.filterwarnings("ignore")
    trainer = quiet_trainer(_strategy(), world_size, max_steps=1)
    trainer.fit(tiny_model(), datamodule=FixedBatches())
    try:
        trainer.strategy.save_checkpoint({"epoch": 0, "global_step": 1 + rank, "state_dict": {}},
                                         os.path.join(directory, "mixed.ckpt"))
        return "written"
    except CheckpointError as error:
        return str(error)


@pytest.mark.timeout(120)
def test_a_checkpoint_whose_ranks_are_at_different_steps_is_refused_on_every_rank(tmp_path):
    messages = run_ranks(_save_at_steps_worker, 2, str(tmp_path), timeout=100)
    assert messages[0] == messages[1] == (
        f"checkpoint {tmp_path / 'mixed.ckpt'} was not written: the processes are at different training steps (rank 0 "
        "at epoch 0, global step 1, rank 1 at epoch 0, global step 2), so its parts would mix two steps' weights; a "
        "rank stopped in the middle of a step. Resume from the last checkpoint written before")
    assert list(tmp_path.iterdir()) == []


# ----- the port rank 0 listens on ---------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_a_master_port_another_run_holds_is_refused_by_name_and_a_chosen_port_taken_since_is_chosen_again(
        compose_train, monkeypatch):
    """Two runs given the same ``MASTER_PORT``: the second died with torch's bare ``DistNetworkError ...
    EADDRINUSE``; it now fails before starting any rank, naming the port, the variable and that another run holds it.
    With no port given, a free one is chosen (again, if the one chosen was taken before rank 0 listened on it)."""
    holder = socket.socket()  # another run's rank 0, listening
    holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    holder.bind(("", 0))
    holder.listen()
    port = holder.getsockname()[1]
    run = [*TINY_RUN, *SMALL_SYNTHETIC, ONE_PROCESS, "evaluate=false", "trainer.max_steps=1",
           "trainer.limit_val_batches=0"]
    try:
        monkeypatch.setenv("MASTER_PORT", str(port))
        with pytest.raises(PortInUseError, match=RELIABILITY_MESSAGES["a port another run holds"]) as caught:
            train(compose_train(*run))
        assert str(caught.value).startswith(f"MASTER_PORT={port}: port {port} is already in use")
        monkeypatch.delenv("MASTER_PORT")
        offered = iter([port])  # the first port the system offers is taken before rank 0 listens on it
        monkeypatch.setattr(lightning_environment, "find_free_network_port",
                            lambda: next(offered, None) or free_port())
        assert train(compose_train(*run))["checkpoint"]
    finally:
        holder.close()

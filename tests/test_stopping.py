"""A run stopped by a signal (issue #32): every rank stops at the next step boundary, saves a checkpoint together and
raises ``RunStopped``; the checkpoint resumes exactly.

The signal arrives *inside* a training step (sent from a stage's forward pass, in the middle of the pipeline's
transfers), to every rank (a scheduler, ``docker stop``, Ctrl-C in a terminal) or to one rank only (``kill``). The
stopped run is then resumed by fresh objects; its loss curve and final parameters must equal one uninterrupted
one-process run's (1e-5 relative) on every rank, as in ``tests/test_resume.py``. Also: SLURM's requeue signal under
``SLURMEnvironment(auto_requeue=True)`` saves Lightning's HPC checkpoint and requeues the job with ``scontrol``.
"""

from __future__ import annotations

import csv
import os
import re
import signal
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.app.training import train
from lightning_mp_lstm.checkpoint import read_checkpoint
from lightning_mp_lstm.data import LMDataModule
from lightning_mp_lstm.strategy.stopping import RunStopped, check_stop_signals
from tests.helpers import (
    ONE_PROCESS,
    RELIABILITY_MESSAGES,
    SMALL_SYNTHETIC,
    TINY_RUN,
    TrainLosses,
    assert_ranks_match,
    parameters_of,
    processes_in_group,
    quiet_trainer,
    run_ranks,
    start_command,
    tiny_model,
)

DATA = {"source": "synthetic", "batch_size": 8, "num_auto_buckets": 3, "shuffle": True, "seed": 5,
        "synthetic": {"num_train": 96, "num_valid": 16, "num_test": 16, "vocab_size": 40, "max_length": 12}}
TOTAL = 20  # the whole run, in optimizer steps (an epoch has 13)
SIGNALLED_AT = 4  # the signal arrives inside the step after this global step: the run stops after step 6
LAYOUTS = {"pp2": dict(n_microbatches=2), "dp2_pp2": dict(data_parallel_size=2, n_microbatches=2, schedule="GPipe")}
#: Who gets the signal, per layout: every rank, or one rank that is not global rank 0.
SCENARIOS = {"pp2": [("SIGTERM", "every rank"), ("SIGTERM", (1,)), ("SIGINT", "every rank")],
             "dp2_pp2": [("SIGTERM", "every rank"), ("SIGTERM", (2,))]}
DEADLINE = 30.0  # seconds from the signal to every rank's RunStopped (the bar)


class SignalInsideAStep(pl.Callback):
    """At global step ``at``, the ranks in ``victims`` send ``signum`` to themselves from the forward pass of their
    first block (inside the pipeline schedule); records when."""

    def __init__(self, signum: int, victims: Any, at: int) -> None:
        self.signum, self.victims, self.at = signum, victims, at
        self.sent_at: float | None = None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.at or (self.victims != "every rank" and trainer.global_rank not in self.victims):
            return
        first = next(iter(trainer.strategy.engine.stage_modules.values())).blocks[0]  # a block this rank runs

        def send(module, inputs, output) -> None:
            handle.remove()
            self.sent_at = time.time()
            os.kill(os.getpid(), self.signum)

        handle = first.register_forward_hook(send)


def _fit(strategy: Any, devices: int, directory: Path, callbacks: list, ckpt_path: str | None = None) -> dict:
    warnings.filterwarnings("ignore")
    data = LMDataModule(**DATA)
    data.setup("fit")
    model = tiny_model(num_layers=2, vocab=data.vocab_size, optimizer="adam", lr=0.01)
    losses = TrainLosses()
    save = ModelCheckpoint(dirpath=directory, save_last=True, save_top_k=0)  # where the stop's last.ckpt goes
    trainer = quiet_trainer(strategy, devices, [losses, save, *callbacks], limit_val_batches=0, max_steps=TOTAL)
    outcome: dict[str, Any] = {"error": None}
    try:
        trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    except RunStopped as stopped:
        outcome = {"error": "RunStopped", "message": str(stopped), "checkpoint": stopped.checkpoint,
                   "exit_code": stopped.exit_code, "ended_at": time.time()}
    return {**outcome, "losses": losses.values, "params": parameters_of(model), "steps": trainer.global_step}


def _stop_worker(rank: int, world_size: int, layout: str, directory: str) -> dict:
    out = {}
    for i, (name, victims) in enumerate(SCENARIOS[layout]):
        def strategy() -> MPLSTMStrategy:
            return MPLSTMStrategy(report_after_steps=None, timeout=60, stop_signals=("SIGTERM", "SIGINT"),
                                  **LAYOUTS[layout])

        signaller = SignalInsideAStep(signal.Signals[name], victims, SIGNALLED_AT)
        stopped = _fit(strategy(), world_size, Path(directory, str(i)), [signaller])
        stopped["sent_at"] = signaller.sent_at
        resumed = _fit(strategy(), world_size, Path(directory, f"{i}-resumed"), [], ckpt_path=stopped["checkpoint"])
        out[(name, str(victims))] = {"stopped": stopped, "resumed": resumed}
    return out


_REFERENCE: dict[str, Any] = {}


def _reference(tmp_path: Path) -> dict:
    """The uninterrupted run on one process (Lightning's default strategy)."""
    if not _REFERENCE:
        _REFERENCE.update(_fit("auto", 1, tmp_path / "reference", []))
        assert [step for step, _ in _REFERENCE["losses"]] == list(range(1, TOTAL + 1))
    return _REFERENCE


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("layout", "world_size"), [("pp2", 2), ("dp2_pp2", 4)])
@pytest.mark.processes
def test_a_signal_stops_every_rank_at_the_step_boundary_and_the_checkpoint_resumes_exactly(layout, world_size,
                                                                                           tmp_path):
    per_rank = run_ranks(_stop_worker, world_size, layout, str(tmp_path), timeout=360)
    reference = _reference(tmp_path)
    # Sent inside step SIGNALLED_AT + 1; agreed by the all-reduce started at its end and read at the next boundary.
    stop = SIGNALLED_AT + 2
    for name, victims in SCENARIOS[layout]:
        runs = [rank[(name, str(victims))] for rank in per_rank]
        sent = [run["stopped"]["sent_at"] for run in runs if run["stopped"]["sent_at"] is not None]
        assert len(sent) == (world_size if victims == "every rank" else 1), (name, victims)
        for rank, run in enumerate(runs):
            stopped, resumed = run["stopped"], run["resumed"]
            assert stopped["error"] == "RunStopped", (name, victims, rank, stopped)
            assert stopped["exit_code"] == 128 + signal.Signals[name]
            assert re.match(RELIABILITY_MESSAGES["stopped by a signal"].replace("SIGTERM", name),
                            stopped["message"]), stopped["message"]
            assert f"at global step {stop} (epoch 0, after batch_idx {stop - 1} of 13)" in stopped["message"]
            assert stopped["steps"] == stop and stopped["checkpoint"] == runs[0]["stopped"]["checkpoint"]
            assert stopped["ended_at"] - min(sent) < DEADLINE, (name, victims, rank)
            # The stopped run trained what the reference did up to the stop, and the resumed run the rest.
            for got, expected in ((stopped["losses"], reference["losses"][:stop]),
                                  (resumed["losses"], reference["losses"][stop:])):
                assert [s for s, _ in got] == [s for s, _ in expected], (name, victims, rank)
                for (_, loss), (_, want) in zip(got, expected):
                    assert loss == pytest.approx(want, rel=1e-5), (name, victims, rank)
            assert resumed["error"] is None and resumed["steps"] == TOTAL
        checkpoint = read_checkpoint(runs[0]["stopped"]["checkpoint"])
        assert checkpoint["global_step"] == stop and Path(runs[0]["stopped"]["checkpoint"]).name == "last.ckpt"
        assert_ranks_match([run["resumed"]["params"] for run in runs], reference["params"])


def test_stop_signals_are_checked_by_name():
    assert check_stop_signals(["SIGTERM", "sigint"]) == (signal.SIGTERM, signal.SIGINT)
    with pytest.raises(ValueError, match=r"stop_signals: unknown signal 'SIGKILL' in \['SIGKILL'\]; allowed: SIGTERM"):
        MPLSTMStrategy(stop_signals=["SIGKILL"])


# ----- SLURM ------------------------------------------------------------------------------------------------
@pytest.mark.processes
def test_the_slurm_requeue_signal_saves_the_hpc_checkpoint_and_requeues(tmp_path, monkeypatch):
    """Under ``SLURMEnvironment(auto_requeue=True)`` the requeue signal (SIGUSR1) ends the run at the step boundary
    with Lightning's HPC checkpoint, from which a requeued job resumes by itself, and Lightning's requeue command."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    calls = tmp_path / "scontrol.calls"
    fake = tmp_path / "bin" / "scontrol"
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport sys\nopen({str(calls)!r}, 'a').write(' '.join(sys.argv[1:]))\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    for key, value in {"SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
                       "SLURM_NODEID": "0", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "mp-lstm",
                       "SLURM_NODELIST": "127.0.0.1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(lightning_mp_lstm.base.testing.free_port()))
    warnings.filterwarnings("ignore")
    data = LMDataModule(**DATA)
    data.setup("fit")
    strategy = MPLSTMStrategy(report_after_steps=None, timeout=60)
    trainer = quiet_trainer(strategy, 1, [SignalInsideAStep(signal.SIGUSR1, "every rank", 2)], max_steps=TOTAL,
                            limit_val_batches=0, plugins=[SLURMEnvironment(auto_requeue=True)],
                            default_root_dir=str(tmp_path))
    try:
        with pytest.raises(RunStopped) as caught:
            trainer.fit(tiny_model(vocab=data.vocab_size), datamodule=data)
    finally:
        torch.distributed.destroy_process_group()  # launched externally (SLURM): no launcher to release it
    assert caught.value.requeued and caught.value.signal_name == "SIGUSR1"
    assert caught.value.checkpoint == str(tmp_path / "hpc_ckpt_1.ckpt")
    assert "the SLURM job was requeued and resumes from it" in str(caught.value)
    assert read_checkpoint(caught.value.checkpoint)["global_step"] == 3
    assert calls.read_text() == "requeue 4242"



# ----- train.py ---------------------------------------------------------------------------------------------
def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


LONG_RUN = [*TINY_RUN, *SMALL_SYNTHETIC, "trainer.limit_train_batches=null", "trainer.max_epochs=100",
            "data.synthetic.num_train=2000"]


def _start_training(tmp_path: Path) -> tuple[Any, list[str]]:
    """``python train.py layout=pp2`` of :data:`LONG_RUN` into ``<tmp_path>/run``, a few seconds into its training
    steps; its output lines as they come."""
    args = [sys.executable, "train.py", "layout=pp2", *LONG_RUN, f"hydra.run.dir={tmp_path}/run"]
    proc = start_command(args)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    assert _wait_for(lambda: any("partition (costs by" in line for line in lines), 150), "".join(lines)[-3000:]
    time.sleep(2.0)  # into the training steps
    assert len(processes_in_group(proc.pid)) == 2
    return proc, lines


def _logged_steps(run: Path) -> list[int]:
    """The ``step`` of every row of the run's ``logs/metrics.csv``."""
    with (run / "logs" / "metrics.csv").open(newline="") as handle:
        return [int(float(row["step"])) for row in csv.DictReader(handle)]


def _end_of(proc: Any) -> float:
    """Seconds until every process of ``proc``'s group ended (at most :data:`DEADLINE`); the rest are killed."""
    started = time.monotonic()
    try:
        assert _wait_for(lambda: not processes_in_group(proc.pid), DEADLINE), processes_in_group(proc.pid)
        return time.monotonic() - started
    finally:
        for pid in processes_in_group(proc.pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("name", "to"), [("SIGINT", "every process"), ("SIGTERM", "the launching process"),
                                          ("SIGHUP", "every process")])
@pytest.mark.processes
def test_train_py_stops_saves_and_tells_how_to_resume(name, to, tmp_path, compose_train):
    """Ctrl-C in a terminal (SIGINT to every process of the job), ``kill`` / ``docker stop`` (SIGTERM to the process
    that launched the ranks) or a closed terminal or dropped ssh connection (SIGHUP to every process): every process
    ends within 30 s, the job's status is 128 + the signal's number, the output and the run's log file say where the
    run stopped and the command that resumes it in the same run folder, and resuming there continues from that step,
    its checkpoint and the run's metrics."""
    proc, lines = _start_training(tmp_path)
    signum = signal.Signals[name]
    os.killpg(proc.pid, signum) if to == "every process" else os.kill(proc.pid, signum)
    ended_in = _end_of(proc)
    output = "".join(lines)
    assert proc.wait(timeout=10) == 128 + signum, output[-3000:]
    assert ended_in < DEADLINE
    stopped = re.search(RELIABILITY_MESSAGES["stopped by a signal"].replace("SIGTERM", name), output)
    assert stopped, output[-3000:]
    step = int(re.search(r"at global step (\d+)", stopped.group(0)).group(1))
    run = tmp_path / "run"
    checkpoint = run / "checkpoints" / "last.ckpt"
    resume = re.search(RELIABILITY_MESSAGES["stopped by a signal, train.py's last line"], output)
    assert resume and resume.group(0).startswith("Resume with: python train.py layout=pp2 trainer=ci "), output[-2000:]
    assert resume.group(0).endswith(f" hydra.run.dir={run} ckpt_path={checkpoint}"), output[-2000:]
    assert read_checkpoint(checkpoint)["global_step"] == step and "Traceback" not in output
    assert stopped.group(0) in (run / "train.log").read_text()  # the terminal may be gone: the run's log has it
    before = _logged_steps(run)
    # Resume it in its folder, as the printed command does (on one process: a checkpoint of any layout resumes on
    # any), never validating: the checkpoint callback's state carries over, and last.ckpt is written again.
    train(compose_train(*LONG_RUN, ONE_PROCESS, f"ckpt_path={checkpoint}", f"trainer.max_steps={step + 3}",
                        "trainer.limit_val_batches=0", "evaluate=false", f"paths.output_dir={run}"))
    assert read_checkpoint(checkpoint)["global_step"] == step + 3
    # last.ckpt again, not last-v1.ckpt (a best.ckpt too when the stopped run finished an epoch before the signal).
    assert [p.name for p in checkpoint.parent.iterdir() if p.name.startswith("last")] == ["last.ckpt"]
    after = _logged_steps(run)  # the stopped run's rows are kept (Lightning's CSVLogger deleted them), then the new
    assert after[:len(before)] == before and before[0] == 0 and after[-1] > before[-1], (before, after)


@pytest.mark.timeout(200)
@pytest.mark.processes
def test_ctrl_c_twice_ends_every_process_at_once_saying_what_was_kept(tmp_path):
    """A second Ctrl-C, however soon after the first, ends every process at once with status 130 and a short message
    that says which checkpoint is kept and how to resume from it: no traceback (there were 118 lines of them)."""
    proc, lines = _start_training(tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    assert _wait_for(lambda: any("SIGINT received" in line for line in lines), DEADLINE), "".join(lines)[-3000:]
    told = len(lines)
    os.killpg(proc.pid, signal.SIGINT)
    ended_in = _end_of(proc)
    output = "".join(lines)
    assert proc.wait(timeout=10) == 130 and ended_in < 10, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-5000:]
    after = [line for line in lines[told:] if line.strip()]
    assert len(after) <= 4, after
    stopped = re.search(RELIABILITY_MESSAGES["stopped by a signal"].replace("SIGTERM", "SIGINT"), output)
    at_once = re.search(RELIABILITY_MESSAGES["Ctrl-C twice"], output)
    assert stopped or at_once, output[-3000:]  # the stop was told already, or the second Ctrl-C tells what is kept
    if at_once and "was written to" in at_once.group(0):
        step = int(re.search(r"global step (\d+)", at_once.group(0)).group(1))
        assert read_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")["global_step"] == step
    if at_once and "no checkpoint" in at_once.group(0):
        assert not (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()

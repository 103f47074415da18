"""Hydra multirun across layouts: every job starts, and ends, its own set of rank processes.

``JobLauncher`` gives each child rank the command of its own job (no ``-m``, no sweep lists) and
``JobLauncher.release()`` ends a job so that the next one in the same process spawns a correctly sized set.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies.launchers.subprocess_script import _launch_process_observer
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from lightning_mp_lstm.strategy.launcher import LAUNCH_ENV, JobLauncher, hydra_quote
from tests.helpers import (
    ROOT,
    SMALL_SYNTHETIC,
    TINY_RUN,
    free_port,
    processes_in_group,
    run_command_and_leftovers,
)

TINY = [*TINY_RUN, *SMALL_SYNTHETIC]


def _listing(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()} if path.is_dir() else set()


def _run_sweep(tmp_path: Path, layouts: str, world_sizes: list[int], timeout: float = 150) -> None:
    """Run ``train.py -m layout=<layouts>`` and check it ran each job once, each with its own processes.

    The sweep directory carries a microsecond timestamp: a child rank that re-ran the sweep (the old bug)
    would resolve it again and make a second directory next to it.
    """
    sweeps = tmp_path / "sweeps"
    repo_multirun = _listing(ROOT / "multirun")
    args = [sys.executable, "train.py", "-m", f"layout={layouts}", *TINY,
            f"hydra.sweep.dir={sweeps}/" + "${now:%H-%M-%S-%f}"]
    result, leftovers = run_command_and_leftovers(args, timeout=timeout)
    out = result.stdout
    assert result.returncode == 0, out[-4000:]
    assert leftovers == [], f"processes of the run outlived it: {leftovers}"
    # Every job ran exactly once: one closing table each, printed by its rank 0.
    assert out.count("validation perplexity") == len(world_sizes), out[-4000:]
    # Each job registered a fresh default group of its own size (a one-process job too: one strategy runs
    # every layout).
    started = [int(n) for n in re.findall(r"Starting with (\d+) processes", out)]
    assert started == world_sizes, out[-4000:]
    (sweep,) = [p for p in sweeps.iterdir()]  # one sweep, no second multirun directory
    assert _listing(ROOT / "multirun") == repo_multirun
    jobs = sorted(p.name for p in sweep.iterdir() if p.is_dir())
    assert jobs == [str(i) for i in range(len(world_sizes))]
    for num, layout in enumerate(layouts.split(",")):
        job = sweep / str(num)
        assert f"layout={layout}" in (job / ".hydra" / "overrides.yaml").read_text()
        assert (job / "checkpoints" / "last.ckpt").is_file(), sorted(p.name for p in job.rglob("*"))
        assert (job / "logs" / "metrics.csv").is_file(), sorted(p.name for p in job.rglob("*"))
        # The children wrote their Hydra logs into their own job's directory, and only there.
        children = sorted(p.name for p in job.glob("train_ddp_process_*.log"))
        assert children == [f"train_ddp_process_{r}.log" for r in range(1, world_sizes[num])]


@pytest.mark.timeout(180)
@pytest.mark.processes
def test_multirun_over_two_world_sizes(tmp_path):
    """`-m layout=pp2,pp4`: the second job used to find the first job's 2-process group (mesh size error)."""
    _run_sweep(tmp_path, "pp2,pp4", [2, 4])


@pytest.mark.timeout(180)
@pytest.mark.processes
def test_multirun_single_then_pipeline(tmp_path):
    """`-m layout=single,pp2`: the spawned rank used to re-run the sweep, training job #0 on its own."""
    _run_sweep(tmp_path, "single,pp2", [1, 2])


# ----- the launcher in this process ------------------------------------------------------------------------
@pytest.fixture
def clean_launch_env():
    saved = {key: os.environ.get(key) for key in LAUNCH_ENV}
    threads, rank = torch.get_num_threads(), rank_zero_only.rank
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    torch.set_num_threads(threads)
    rank_zero_only.rank = rank


@pytest.mark.timeout(60)
def test_release_restores_the_environment_and_destroys_the_group(clean_launch_env, monkeypatch):
    for key in ("MASTER_ADDR", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    before = {key: os.environ.get(key) for key in LAUNCH_ENV}
    environment = LightningEnvironment()
    launcher = JobLauncher(environment, num_processes=1, num_nodes=1)

    def job() -> int:
        environment.set_world_size(1)
        environment.set_global_rank(0)
        dist.init_process_group("gloo", rank=0, world_size=1)
        return dist.get_world_size()

    assert launcher.launch(job) == 1
    assert environment.creates_processes_externally  # what made the next job spawn nothing
    assert os.environ["WORLD_SIZE"] == "1" and "OMP_NUM_THREADS" in os.environ
    launcher.release()
    assert not dist.is_initialized()
    assert {key: os.environ.get(key) for key in LAUNCH_ENV} == before
    assert not LightningEnvironment().creates_processes_externally
    assert rank_zero_only.rank == 0
    launcher.release()  # twice is fine
    assert {key: os.environ.get(key) for key in LAUNCH_ENV} == before


@pytest.mark.timeout(60)
def test_release_on_a_process_that_launched_nothing_only_destroys_the_group(clean_launch_env, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "1")  # a child rank: its processes were created by its parent
    before = dict(os.environ)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    JobLauncher(LightningEnvironment(), num_processes=2, num_nodes=1).release()
    assert not dist.is_initialized()
    assert dict(os.environ) == before


@pytest.mark.timeout(60)
@pytest.mark.processes
def test_release_kills_children_that_outlive_the_wait_without_lightnings_observer_killing_us(clean_launch_env):
    launcher = JobLauncher(LightningEnvironment(), num_processes=2, num_nodes=1, release_timeout=0.5)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    launcher.procs.append(child)
    _launch_process_observer(launcher.procs)  # as Lightning's launch() does; it would SIGKILL us on a -9 child
    observers = [t for t in threading.enumerate() if t.name == "child-process-observer"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        launcher.release()
    assert child.returncode == -9
    assert any(f"[{child.pid}]" in str(w.message) and "killed" in str(w.message) for w in caught)
    assert not any(t.is_alive() for t in observers)  # ended without signalling this process
    assert processes_in_group(child.pid) == []
    launcher.release()


@pytest.mark.parametrize("path", [
    "outputs/sweep/layout=pp2,seed=1", "outputs/a b/c", "outputs/it's", 'outputs/say "x"', "outputs/back\\slash\\",
    "outputs/q\\'x", "outputs/${oc.env:HOME}", "outputs/[1,2]/{k:v}", "outputs/\\${x}",
])
def test_hydra_quote_parses_back_to_the_same_path(path):
    with initialize(version_base="1.3", config_path=None):
        cfg = compose(overrides=[f"+out={hydra_quote(path)}"])
    assert cfg.out == path


TWO_FITS = '''
import sys, warnings
import lightning.pytorch as pl
import torch
sys.path.insert(0, {root!r})
from lightning_mp_lstm import MPLSTMStrategy
from tests.helpers import TimeFirstStream, tiny_model

warnings.filterwarnings("ignore")
for hidden in (8, 12):  # two jobs of one script, each on two processes
    torch.manual_seed(0)
    strategy = MPLSTMStrategy(pipeline_parallel_size=2, n_microbatches=2, report_after_steps=None, timeout=30)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         limit_val_batches=0)
    trainer.fit(tiny_model(vocab=30, hidden_size=hidden), datamodule=TimeFirstStream(30, time_first=False))
    print(f"rank {{trainer.global_rank}} trained hidden={{hidden}}", flush=True)
    if {release}:
        strategy.shutdown()
'''


@pytest.mark.timeout(150)
@pytest.mark.parametrize("release", [False, True])
@pytest.mark.processes
def test_a_script_with_two_jobs_never_pairs_a_rank_with_another_job(tmp_path, release):
    """Lightning's rank processes run the whole script: without shutdown() between the jobs they follow it job by
    job; with it, the second job's processes start the script again, and would train its first job's model beside
    rank 0's second: each is refused by name before any collective."""
    script = tmp_path / "two_fits.py"
    script.write_text(TWO_FITS.format(root=str(ROOT), release=release))
    result, leftovers = run_command_and_leftovers([sys.executable, str(script)], timeout=140)
    out = result.stdout
    assert leftovers == [], f"processes of the run outlived it: {leftovers}"
    if not release:
        assert result.returncode == 0, out[-4000:]
        assert sorted(re.findall(r"rank (\d) trained hidden=(\d+)", out)) == [
            ("0", "12"), ("0", "8"), ("1", "12"), ("1", "8")], out[-4000:]
        return
    assert result.returncode != 0 and "trained hidden=12" not in out, out[-4000:]
    assert "mp_lstm: rank process 1 stops: its job ended with strategy.shutdown() and the script goes on to call " \
           "number 2" in out, out[-4000:]

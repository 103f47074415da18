"""Every run writes its own folder (issue #32): a ``python train.py`` run and a ``torchrun`` run started at the same
moment get two folders, each with its own logs and checkpoints, and the two ranks that ``torchrun`` started share
theirs (no stray folder per rank)."""

from __future__ import annotations

import csv
import os
import re
import signal
import sys
from datetime import datetime

import pytest
import yaml
from omegaconf import OmegaConf

from lightning_mp_lstm.base.testing import free_port
from tests.helpers import RELIABILITY_MESSAGES, ROOT, SMALL_SYNTHETIC, TINY_RUN, processes_in_group, start_command

QUICK = [*TINY_RUN, *SMALL_SYNTHETIC, "trainer.max_steps=2", "evaluate=false", "~callbacks.timeline"]


@pytest.mark.timeout(240)
@pytest.mark.processes
def test_runs_started_together_write_separate_folders(tmp_path):
    pattern = yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())["hydra"]["run"]["dir"]
    assert pattern.startswith("outputs/")
    run_dir = f"hydra.run.dir={tmp_path}/{pattern}"  # train.yaml's own pattern, under this test's directory
    plain = [sys.executable, "train.py", "layout=single", *QUICK, run_dir]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                "--master_addr=127.0.0.1", f"--master_port={free_port()}", "train.py", "layout=pp2", *QUICK, run_dir]
    procs = [start_command(plain), start_command(torchrun)]
    try:
        outputs = [proc.communicate(timeout=220)[0] for proc in procs]
    finally:
        for proc in procs:
            for pid in processes_in_group(proc.pid):
                os.kill(pid, signal.SIGKILL)
    assert [proc.returncode for proc in procs] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    (day,) = (tmp_path / "outputs").iterdir()
    folders = sorted(day.iterdir())
    assert len(folders) == 2, [f.name for f in folders]  # one per run: none shared, none stray
    assert all(re.fullmatch(RELIABILITY_MESSAGES["runs started together"], f.name) for f in folders), folders
    for folder in folders:
        assert (folder / "checkpoints" / "last.ckpt").is_file(), sorted(p.name for p in folder.rglob("*"))
        with open(folder / "logs" / "metrics.csv") as handle:
            steps = [row["step"] for row in csv.DictReader(handle) if row.get("train/loss")]
        assert steps == ["0", "1"], (folder.name, steps)  # one run's two steps, nobody else's


def test_runs_started_in_the_same_microsecond_get_two_folders_and_the_ranks_of_one_run_one(monkeypatch):
    """train.yaml's run folder, resolved with the clock frozen: two runs (two pids) get two names; two ranks that
    ``torchrun`` started (one launcher, their parent) get one."""
    from hydra.core.utils import setup_globals

    from lightning_mp_lstm.app import run_name
    from lightning_mp_lstm.app.training import train  # noqa: F401  (registers the resolver, as train.py does)

    frozen = datetime(2026, 11, 25, 18, 38, 39, 119042)
    monkeypatch.setattr(run_name, "datetime", type("Frozen", (), {"now": staticmethod(lambda: frozen),
                                                                   "fromtimestamp": datetime.fromtimestamp}))
    OmegaConf.register_new_resolver("now", lambda pattern: frozen.strftime(pattern), replace=True)
    pattern = yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())["hydra"]["run"]["dir"]

    def resolve(pid: int, parent: int) -> str:
        monkeypatch.setattr(os, "getpid", lambda: pid)
        monkeypatch.setattr(os, "getppid", lambda: parent)
        return OmegaConf.create({"dir": pattern}).dir  # a new config: nothing cached

    try:
        assert resolve(1001, 1) != resolve(1002, 1)  # two python train.py runs
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
        ranks = {resolve(pid, os.getppid()) for pid in (2001, 2002)}  # two ranks of one torchrun (a real parent)
        assert len(ranks) == 1
    finally:
        setup_globals()  # Hydra's own "now" again

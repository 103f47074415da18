"""Every run writes its own folder (issue #32): two ``python train.py`` runs and a ``torchrun`` run started at the
same moment get three folders, each with its own logs and checkpoints, and the ranks that ``torchrun`` started
share theirs (no stray folder per rank)."""

from __future__ import annotations

import csv
import os
import re
import signal
import sys

import pytest
import yaml

from lightning_mp_lstm.testing import free_port
from tests.helpers import RELIABILITY_MESSAGES, ROOT, SMALL_SYNTHETIC, TINY_RUN, processes_in_group, start_command

QUICK = [*TINY_RUN, *SMALL_SYNTHETIC, "trainer.max_steps=2", "evaluate=false", "optimized_metric=null",
         "~callbacks.timeline"]


@pytest.mark.timeout(240)
def test_runs_started_together_write_separate_folders(tmp_path):
    pattern = yaml.safe_load((ROOT / "conf" / "train.yaml").read_text())["hydra"]["run"]["dir"]
    assert pattern.startswith("outputs/")
    run_dir = f"hydra.run.dir={tmp_path}/{pattern}"  # train.yaml's own pattern, under this test's directory
    plain = [sys.executable, "train.py", "layout=single", *QUICK, run_dir]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
                "--master_addr=127.0.0.1", f"--master_port={free_port()}", "train.py", "layout=pp2", *QUICK, run_dir]
    procs = [start_command(plain), start_command(plain), start_command(torchrun)]
    try:
        outputs = [proc.communicate(timeout=220)[0] for proc in procs]
    finally:
        for proc in procs:
            for pid in processes_in_group(proc.pid):
                os.kill(pid, signal.SIGKILL)
    assert [proc.returncode for proc in procs] == [0, 0, 0], "\n".join(o[-2000:] for o in outputs)
    (day,) = (tmp_path / "outputs").iterdir()
    folders = sorted(day.iterdir())
    assert len(folders) == 3, [f.name for f in folders]  # one per run: none shared, none stray
    assert all(re.fullmatch(RELIABILITY_MESSAGES["runs started together"], f.name) for f in folders), folders
    for folder in folders:
        assert (folder / "checkpoints" / "last.ckpt").is_file(), sorted(p.name for p in folder.rglob("*"))
        with open(folder / "logs" / "metrics.csv") as handle:
            steps = [row["step"] for row in csv.DictReader(handle) if row.get("train/loss")]
        assert steps == ["0", "1"], (folder.name, steps)  # one run's two steps, nobody else's

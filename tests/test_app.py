"""The Hydra application end to end: in-process `train(cfg)`, real PTB files, and multi-process launches."""

from __future__ import annotations

import math
import os
import signal
import sys
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_mp_lstm.app import train
from tests.helpers import ROOT, SMALL_SYNTHETIC, TINY_RUN, free_port, run_command, start_command

TINY = [*TINY_RUN, *SMALL_SYNTHETIC]


def _compose(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=[f"checkpoint_dir={tmp_path}/checkpoints", *overrides])


@pytest.mark.timeout(120)
def test_train_on_the_synthetic_default(tmp_path):
    torch.set_num_threads(1)
    summary = train(_compose(tmp_path, *TINY))
    assert math.isclose(summary["val_ppl"], math.exp(summary["val_loss"]), rel_tol=1e-9)
    assert math.isfinite(summary["test_ppl"])
    # The floor and the unigram baseline come from the synthetic language itself.
    assert 1 < summary["entropy_floor_ppl"] < summary["unigram_ppl"]
    assert Path(summary["checkpoint"]).is_file()
    assert (Path(summary["logs"]) / "metrics.csv").is_file()
    checkpoint = torch.load(summary["checkpoint"], weights_only=False)
    assert "embedding.weight" in checkpoint["state_dict"]
    assert checkpoint["LMDataModule"]["vocab"]["tokens"][:3] == ["<pad>", "<unk>", "<eos>"]


@pytest.mark.timeout(120)
def test_train_on_ptb_files(tmp_path, ptb):
    torch.set_num_threads(1)
    overrides = [
        "trainer=ci",
        "data=ptb",
        f"data.train={ptb / 'ptb.valid.txt'}",
        f"data.valid={ptb / 'ptb.test.txt'}",
        f"data.test={ptb / 'ptb.test.txt'}",
        "buckets=mxnet",
        "model.hidden_size=16",
        "model.embedding_dim=16",
    ]
    summary = train(_compose(tmp_path, *overrides))
    # The vocabulary comes from the training file (PTB valid: 6,021 distinct words + <pad>).
    assert summary["entropy_floor_ppl"] is None
    assert 1 < summary["val_ppl"] < 2 * 6100
    assert math.isfinite(summary["test_ppl"])


@pytest.mark.timeout(240)
def test_train_py_launches_a_two_stage_pipeline(tmp_path):
    """`python train.py layout=pp2` starts rank 1 itself through Lightning's launcher (Hydra-aware)."""
    args = [sys.executable, "train.py", "layout=pp2", *TINY, f"hydra.run.dir={tmp_path}/run"]
    result = run_command(args, timeout=220)
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("validation perplexity") == 1  # the table is printed by rank 0 only
    assert "embedding, lstm.0" in result.stdout  # the partition report


@pytest.mark.timeout(240)
def test_two_node_torchrun_on_localhost(tmp_path):
    """Two `torchrun --nnodes=2` processes (node ranks 0 and 1) run one pipeline across "nodes"."""
    port = free_port()
    common = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1",
              "--master_addr=127.0.0.1", f"--master_port={port}"]
    procs = []
    for node in (0, 1):
        args = [*common, f"--node_rank={node}", "train.py", "layout=pp2", "trainer.num_nodes=2", *TINY,
                f"hydra.run.dir={tmp_path}/node{node}"]
        procs.append(start_command(args))
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=220)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert "validation perplexity" in outputs[0] and "validation perplexity" not in outputs[1]

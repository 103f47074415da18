"""The Hydra application end to end: in-process `train(cfg)`, real PTB files, and multi-process launches."""

from __future__ import annotations

import json
import math
import os
import signal
import sys
from pathlib import Path

import hydra
import pytest
import torch
from hydra import compose, initialize_config_dir

from lightning_mp_lstm.app.training import (
    build_model,
    build_strategy,
    build_trainer,
    format_summary,
    metric_value,
    train,
)
from tests.helpers import (
    ONE_PROCESS,
    ROOT,
    SMALL_SYNTHETIC,
    TINY_RUN,
    exit_thread_probe,
    free_port,
    run_command,
    start_command,
    threads_at_exit,
)

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes

TINY = [*TINY_RUN, *SMALL_SYNTHETIC]
IN_PROCESS = [*TINY, ONE_PROCESS]


def _compose(tmp_path: Path, *overrides: str):
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return compose(config_name="train", overrides=[f"paths.output_dir={tmp_path}", *overrides])


@pytest.mark.timeout(120)
def test_one_process_run_builds_on_meta_materializes_every_block_and_prints_the_table(tmp_path, capsys):
    """A one-process `python train.py layout=single` runs through the same strategy as every layout:
    the model is built on the meta device, the strategy materializes every block on its device, and the run
    ends with the usual closing table."""
    torch.set_num_threads(1)
    record = tmp_path / "devices.json"
    cfg = _compose(tmp_path, *IN_PROCESS, "+callbacks.devices._target_=tests.helpers.RecordBlockDevices",
                   f"+callbacks.devices.path={record}")
    summary = train(cfg)
    seen = json.loads((tmp_path / "devices.rank0.json").read_text())
    blocks = ["embedding", "lstm.0", "lstm.1", "decoder"]
    assert seen["strategy"] == "MPLSTMStrategy" and seen["world_size"] == 1
    assert seen["setup"] == {block: ["meta"] for block in blocks}  # no storage before the strategy's setup
    device = seen["root_device"]
    assert torch.device(device).type == ("cuda" if torch.cuda.is_available() else "cpu")
    for when in ("train_start", "fit_end"):
        assert seen[when] == {block: [device] for block in blocks}, when
    # The closing table: printed once, these rows in this order, the summary's numbers.
    out = capsys.readouterr().out
    assert out.count(format_summary(summary)) == 1
    table = format_summary(summary).splitlines()
    assert [row[:28].strip() for row in table[1:-1]] == [
        "validation perplexity", "test perplexity", "evaluated weights", "synthetic floor (true model)",
        "unigram baseline",
        "train tokens / s", "training time (s)", "total time (s)", "checkpoint", "logs", "timeline (picture, trace)",
    ]
    assert 0 < summary["train_seconds"] < summary["total_seconds"]
    # The timeline callback is on by default: its picture and trace sit in the run directory.
    assert table[-2].split()[-2:] == [f"{tmp_path / 'timeline.png'},", str(tmp_path / "timeline.json")]
    assert (tmp_path / "timeline.png").stat().st_size > 0 and (tmp_path / "timeline.json").stat().st_size > 0
    # The paths group: the run directory (paths.output_dir) holds the logs and the checkpoints.
    assert Path(table[-3].split()[-1]) == tmp_path / "logs" and (tmp_path / "logs" / "metrics.csv").is_file()
    assert table[-4].split()[-1] == str(tmp_path / "checkpoints" / "best.ckpt")
    assert f"{summary['val_ppl']:,.2f}" in table[1]


@pytest.mark.timeout(120)
def test_the_summary_evaluates_the_best_checkpoint(tmp_path, capsys):
    """Validation and test run on best.ckpt, not on the last weights: the table's test perplexity is exp of the
    loss `trainer.test(ckpt_path=best)` gives, and the table says which weights it is from."""
    torch.set_num_threads(1)
    # Validation at steps 2 and 4 of 4; mode=max makes "best" the earlier, higher-loss one, so best != last. A
    # second checkpoint callback (monitoring nothing) keeps the last weights, final.ckpt (Lightning 2.6 rewrites
    # last.ckpt at a validation only together with a new best).
    cfg = _compose(tmp_path, *IN_PROCESS, "trainer.val_check_interval=2", "callbacks.model_checkpoint.mode=max",
                   "+callbacks.final._target_=lightning.pytorch.callbacks.ModelCheckpoint",
                   f"+callbacks.final.dirpath={tmp_path}/final", "+callbacks.final.filename=final")
    summary = train(cfg)
    assert math.isclose(summary["val_ppl"], math.exp(summary["val_loss"]), rel_tol=1e-9)
    # The floor and the unigram baseline come from the synthetic language itself.
    assert 1 < summary["entropy_floor_ppl"] < summary["unigram_ppl"]
    assert (Path(summary["logs"]) / "metrics.csv").is_file()
    best, last = tmp_path / "checkpoints" / "best.ckpt", tmp_path / "final" / "final.ckpt"
    assert summary["checkpoint"] == str(best)
    saved = torch.load(best, weights_only=False)
    assert "embedding.weight" in saved["state_dict"]
    assert saved["LMDataModule"]["vocab"]["tokens"][:3] == ["<pad>", "<unk>", "<eos>"]
    assert saved["global_step"] == 2 and torch.load(last, weights_only=False)["global_step"] == 4
    score = next(s["best_model_score"] for k, s in saved["callbacks"].items() if k.startswith("RunCheckpoint"))
    # Validating the best checkpoint again gives the score it was saved for.
    assert summary["val_loss"] == pytest.approx(float(score), rel=1e-5)
    assert summary["evaluated"] == f"best.ckpt (val/loss {float(score):.4f}, step 2)"
    assert summary["evaluated"] in capsys.readouterr().out
    assert metric_value(summary, "val/loss") == summary["metrics"]["val/loss"] == summary["val_loss"]
    # A plain run has no optimized_metric (only a sweep's config sets one): train.py returns None, exit status 0.
    assert cfg.get("optimized_metric") is None and metric_value(summary, cfg.get("optimized_metric")) is None
    # A sweep asking for a metric the run never logged fails, naming what it did log.
    with pytest.raises(KeyError, match=r"optimized_metric='val/acc' was not logged by this run; it logged: .*"
                                       r"test/loss.*val/loss"):
        metric_value(summary, "val/acc")
    assert summary["metrics"]["test/loss"] == summary["test_loss"]

    # The reference: a fresh Trainer tests each checkpoint.
    again = _compose(tmp_path / "again", *IN_PROCESS, "~callbacks", "~logger", "+trainer.enable_checkpointing=false")
    strategy = build_strategy(again)
    try:
        datamodule = hydra.utils.instantiate(again.data)
        datamodule.prepare_data()
        datamodule.setup("fit")
        model = build_model(again, strategy, datamodule.vocab_size)
        trainer = build_trainer(again, strategy, model)
        losses = {path.stem: trainer.test(model, datamodule=datamodule, ckpt_path=str(path), verbose=False)[0]
                  ["test/loss"] for path in (best, last)}
    finally:
        strategy.shutdown()
    assert summary["test_ppl"] == pytest.approx(math.exp(losses["best"]), rel=1e-6)
    assert summary["test_ppl"] != pytest.approx(math.exp(losses["final"]), rel=1e-3)


@pytest.mark.timeout(120)
def test_train_on_ptb_files(tmp_path, ptb):
    torch.set_num_threads(1)
    overrides = [
        "trainer=ci",
        ONE_PROCESS,
        "data=ptb",
        f"data.train={ptb / 'ptb.valid.txt'}",
        f"data.valid={ptb / 'ptb.test.txt'}",
        f"data.test={ptb / 'ptb.test.txt'}",
        "buckets=mxnet",
        "model.hidden_size=16",
        "model.embedding_dim=16",
        "~callbacks.model_checkpoint",  # Lightning's own checkpoint monitors nothing: the last weights are evaluated
    ]
    summary = train(_compose(tmp_path, *overrides))
    assert summary["evaluated"] == "last (no best checkpoint)"
    assert Path(summary["checkpoint"]).is_file()  # Lightning's own checkpoint, of the last weights
    # The vocabulary comes from the training file (PTB valid: 6,021 distinct words + <pad>).
    assert summary["entropy_floor_ppl"] is None
    assert "synthetic floor" not in format_summary(summary)  # a row only where the language's floor is known
    assert 1 < summary["val_ppl"] < 2 * 6100
    assert math.isfinite(summary["test_ppl"])


@pytest.mark.timeout(240)
def test_train_py_launches_a_two_stage_pipeline(tmp_path):
    """`python train.py layout=pp2` starts rank 1 itself through Lightning's launcher (Hydra-aware)."""
    args = [sys.executable, "train.py", "layout=pp2", *TINY, f"hydra.run.dir={tmp_path}/run"]
    result = run_command(args, timeout=220, **exit_thread_probe(tmp_path / "probe"))
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count("validation perplexity") == 1  # the table is printed by rank 0 only
    assert "embedding, lstm.0" in result.stdout  # the partition report
    _assert_no_process_group_threads_at_exit(result.stdout, processes=2)


def _assert_no_process_group_threads_at_exit(output: str, processes: int) -> None:
    """Every rank destroyed its process groups before the interpreter finalized: none of gloo's threads (its workers
    ``pt_gloo_runloop``, its transport's ``gloo_tcp_loop``) was left then (a gloo worker still running can abort the
    process, pytorch/pytorch#190489)."""
    threads = threads_at_exit(output, "train.py")
    assert len(threads) == processes, output[-3000:]
    assert not [name for names in threads.values() for name in names if "gloo" in name], threads


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
        procs.append(start_command(args, **exit_thread_probe(tmp_path / "probe")))
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
    for output in outputs:
        _assert_no_process_group_threads_at_exit(output, processes=1)

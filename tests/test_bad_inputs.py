"""The bad-input matrix: what a user sees for each wrong config, layout, partition, bucket setting, corpus, data
size or checkpoint, through ``train.py``'s ``train(cfg)``.

Every case must fail with its message, within its deadline (no hang), and leave an existing checkpoint in the
run's checkpoint directory untouched. Every case runs in this process and must fail before any rank is launched
(launching from pytest, even the one process of a one-process run, is turned into an error): ``train()`` checks
the config, the layout, the data module's batches for the layout's replicas and the checkpoint first, also for
layouts of several processes.
"""

from __future__ import annotations

import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.overrides import TorchFunctionMode

from lightning_mp_lstm.app.training import train
from lightning_mp_lstm.checkpoint.integrity import with_record
from lightning_mp_lstm.strategy import launcher
from tests.helpers import ONE_PROCESS, ROOT, SMALL_SYNTHETIC, TINY_RUN, damage_tensor_bytes, run_command_and_leftovers

TINY, SYNTHETIC = TINY_RUN, SMALL_SYNTHETIC


def _base(overrides: list[str]) -> list[str]:
    """The tiny settings, with the synthetic corpus's sizes unless the case picks another corpus."""
    other_corpus = any(o.startswith("data=") for o in overrides)
    return [*TINY, *([] if other_corpus else SYNTHETIC)]


@dataclass(frozen=True)
class Case:
    id: str
    overrides: list[str]
    message: str  # a regular expression the error must contain
    error: str = "Exception"  # the exception's class name (or a base class's)
    files: dict[str, str] = field(default_factory=dict)  # placeholders in overrides -> file kinds to create


CASES = [
    # ----- model config
    Case("model: no LSTM layer", ["model.num_layers=0"], r"num_layers must be a positive integer, got 0"),
    Case("model: negative width", ["model.hidden_size=-4"], r"hidden_size must be a positive integer, got -4"),
    Case("model: dropout of 1.5", ["model.dropout=1.5"], r"dropout must be in \[0, 1\), got 1.5"),
    Case("model: unknown optimizer", ["model.optimizer._target_=torch.optim.RMSpropp"],
         r"model: Error loading 'torch.optim.RMSpropp'"),
    Case("model: tied weights of two widths", ["model.tie_weights=true", "model.embedding_dim=8"],
         r"tie_weights=True needs embedding_dim == hidden_size, got 8 and 16"),
    Case("model: learning rate a word", ["model.optimizer.lr=fast"],
         r"^model.optimizer.lr must be a number \(torch.optim.Adam's lr\), got 'fast'$", "TypeError"),
    # ----- layouts and schedules
    Case("layout: devices for another layout", ["layout=dp2_pp2", "trainer.devices=2"],
         r"the layout needs data_parallel_size=2 x pipeline_parallel_size=2 = 4 processes \(stages_per_rank=1 adds "
         r"virtual stages, not processes\), but the world size is 2", "LayoutError"),
    Case("layout: partition for another layout", ["layout=pp2", "partition=per_layer"],
         r"partition 'per_block' puts each of the 4 blocks on its own stage, but the layout has 2 stages",
         "PartitionError"),
    Case("layout: zero pipeline stages", ["layout.pipeline_parallel_size=0"],
         r"pipeline_parallel_size must be a positive integer( or 'auto')?, got 0", "LayoutError"),
    Case("layout: unknown schedule", ["layout=pp2", "schedule.name=zigzag"],
         r"unknown schedule 'zigzag'; allowed: GPipe, 1F1B, Interleaved1F1B", "LayoutError"),
    Case("layout: one-stage schedule, two stages per rank", ["experiment=pp2_v2", "schedule.name=1F1B"],
         r"schedule 1F1B runs one stage per rank, but stages_per_rank=2", "LayoutError"),
    Case("layout: n_microbatches a word", ["layout=pp2", "schedule.n_microbatches=many"],
         r"n_microbatches must be a positive integer, None or 'auto', got 'many'", "LayoutError"),
    Case("layout: n_microbatches not dividing the batch", ["layout=pp2", "schedule.n_microbatches=3"],
         r"n_microbatches=3 must divide the per-replica batch of 16 sentences .*allowed values: \[1, 2, 4, 8, 16\]",
         "LayoutError"),
    Case("layout: auto microbatches with no valid count", ["layout=pp2", "schedule.n_microbatches=auto",
                                                            "data.batch_size=1"],
         r"n_microbatches='auto' found no count: .*per-replica batch of 1 sentences .*schedule 1F1B with 2 stages",
         "LayoutError"),
    Case("layout: more stages than blocks", ["experiment=pp2_v2", "model.num_layers=1"],
         r"the layout has 4 pipeline stages .* but the model has 3 blocks \(embedding, lstm.0, decoder\)",
         "PartitionError"),
    Case("layout: batch not splitting over replicas", ["layout=dp2", "data.batch_size=15"],
         r"batch_size=15 sentences must split evenly over data_parallel_size=2 replicas", "LayoutError"),
    # ----- partitions
    Case("partition: a flat list", ["partition=manual", "partition.stages=[embedding,lstm.0]"],
         r"the partition is a flat list of block names \['embedding', 'lstm.0'\]; give one list of block names per "
         r"stage", "PartitionError"),
    Case("partition: unknown block", ["partition=manual", "partition.stages=[[embedding,lstm.0],[lstm.7,decoder]]"],
         r"unknown block name 'lstm.7' in stage 1; valid block names are: embedding, lstm.0, lstm.1, decoder",
         "PartitionError"),
    Case("partition: a block missing", ["partition=manual", "partition.stages=[[embedding,lstm.0],[lstm.1]]"],
         r"every block must appear exactly once; missing blocks: decoder", "PartitionError"),
    Case("partition: out of order", ["partition=manual", "partition.stages=[[embedding,lstm.1],[lstm.0,decoder]]"],
         r"stages must be contiguous and in model order: stage 0 has 'lstm.1' where 'lstm.0' was expected",
         "PartitionError"),
    Case("partition: an empty stage", ["partition=manual", "partition.stages=[[embedding,lstm.0,lstm.1,decoder],[]]"],
         r"stage 1 is empty; every stage needs at least one block", "PartitionError"),
    Case("partition: unknown cost", ["partition=balanced", "partition.balance_by=speed"],
         r"unknown balance_by 'speed'; allowed: time, flops, memory", "PartitionError"),
    Case("partition: unknown name", ["partition.stages=zigzag", "layout=pp2"],
         r"unknown partition 'zigzag'; allowed: 'even', 'balanced'", "PartitionError"),
    # ----- buckets
    Case("buckets: a zero length", ["buckets.lengths=[0,8]"],
         r"bucket lengths must be a non-empty list of positive integers, got \[0, 8\]"),
    Case("buckets: a word", ["buckets.lengths=fancy"],
         r"buckets must be a list of lengths, 'auto' or None, got 'fancy'"),
    Case("buckets: no automatic bucket", ["buckets.num_buckets=0"], r"num_buckets must be a positive integer, got 0"),
    Case("buckets: unknown long-sentence policy", ["data.long_sentence_policy=chop"],
         r"unknown long_sentence_policy 'chop'; allowed: split, truncate, drop"),
    # The batch refused is the one the longest bucket holds: that line alone, in the rows of 2 microbatches.
    Case("buckets: a 100,000-token line with no length cap",
         ["data=text", "data.train={long}", "data.valid={text}", "data.test={text}", "buckets.max_length=null",
          "strategy.memory_per_process=1", "model.hidden_size=64", "model.embedding_dim=64", "layout=pp2"],
         r"cannot hold this model and batch: .* \(mostly activations\), more than the 1.00 GiB a process may use "
         r"\(strategy.memory_per_process=1\)\.\nmemory per process[\s\S]*Or: a training batch of the longest bucket "
         r"\(100,001 tokens, as long as the longest training line \(line 8 of .*long.txt, 100,001 tokens\)\) keeps "
         r"about [\d.]+ GiB of activations on pipeline rank 0 \(1 sentence; 2 rows in flight with the empty rows that "
         r"fill its 2 microbatches\). Cap the bucket length "
         r"\(train.py: buckets.max_length=<tokens>; LMDataModule\(max_bucket_length=...\)\): longer lines are then "
         r"split into pieces; or lower data.batch_size / data.max_tokens", "MemoryPlanError",
         files={"long": "long_line", "text": "text"}),
    # ----- corpora
    Case("corpus: unknown source", ["data.source=csv"],
         r"unknown data source 'csv'; expected one of synthetic, ptb, wikitext, text"),
    Case("corpus: PTB without files", ["data=ptb"],
         r"source='ptb' needs a path \(directory\), explicit train/valid/test files or download"),
    Case("corpus: missing directory", ["data=ptb", "data.path=/nonexistent/ptb"],
         r"corpus path '/nonexistent/ptb' does not exist"),
    Case("corpus: directory without a test split", ["data=ptb", "data.path={ptb_no_test}"],
         r"missing test split in corpus directory '.*ptb_partial': looked for ptb.test.txt, wiki.test.tokens",
         files={"ptb_no_test": "ptb_dir_without_test"}),
    Case("corpus: empty training file", ["data=text", "data.train={empty}", "data.valid={text}", "data.test={text}"],
         r"empty.txt.* (is empty|has no sentences)", files={"empty": "empty", "text": "text"}),
    Case("corpus: binary training file", ["data=text", "data.train={binary}", "data.valid={text}", "data.test={text}"],
         r"binary.bin.*line 1", files={"binary": "binary", "text": "text"}),
    Case("corpus: download for WikiText", ["data=wikitext", "data.path=/tmp", "+data.download=true"],
         r"download=True is only available for source='ptb'"),
    # ----- data sizes
    Case("data: batch of 0", ["data.batch_size=0"], r"batch_size must be a positive integer, got 0"),
    Case("data: a negative batch", ["data.batch_size=-3"], r"^data.batch_size must be a positive integer, got -3$"),
    Case("data: token budget below a bucket", ["data.batch_size=null", "data.max_tokens=10", "buckets=mxnet"],
         r"bucket of length \d+ allows only 0 sentences per global batch"),
    Case("data: fewer sentences than replicas", ["layout=dp2", "data.synthetic.num_train=1"],
         r"dataset has 1 examples, fewer than the required 2 \(one per data-parallel replica\)"),
    Case("data: evaluation batch of one sentence for two replicas", ["layout=dp2", "data.eval_batch_size=1"],
         r"valid split \(eval_batch_size=1\): .*allows only 1 sentences per global batch.*need at least one per "
         r"replica \(2\)"),
    Case("data: stream with a token budget", ["data.mode=stream", "data.max_tokens=500"],
         r"mode='stream' cuts the stream into batch_size rows: give batch_size and no max_tokens"),
    Case("data: stream with more rows than tokens", ["data.mode=stream", "data.eval_batch_size=100000"],
         r"valid split: the stream has \d+ tokens, too few for 100000 rows of at least 2 tokens"),
    # ----- checkpoints
    Case("checkpoint: missing file", ["ckpt_path=/nonexistent/model.ckpt"],
         r"checkpoint /nonexistent/model.ckpt does not exist", "FileNotFoundError"),
    Case("checkpoint: truncated", ["ckpt_path={truncated}"],
         r"checkpoint .*truncated.ckpt \([\d,]+ bytes\) cannot be read: it is truncated or not a checkpoint",
         "CheckpointError", files={"truncated": "truncated_checkpoint"}),
    Case("checkpoint: not a checkpoint", ["ckpt_path={text}"],
         r"cannot be read: it is truncated or not a checkpoint", "CheckpointError", files={"text": "text"}),
    Case("checkpoint: another model size", ["ckpt_path={checkpoint}", "model.hidden_size=32", "model.embedding_dim=32"],
         r"the checkpoint's embedding.weight has shape \(\d+, 16\) but the model's has shape \(\d+, 32\)",
         "CheckpointError", files={"checkpoint": "checkpoint"}),
    Case("checkpoint: another number of layers", ["ckpt_path={checkpoint}", "model.num_layers=3"],
         r"the checkpoint does not fit the model: missing \['lstm.2.weight_ih_l0'", "CheckpointError",
         files={"checkpoint": "checkpoint"}),
    Case("checkpoint: another vocabulary", ["ckpt_path={checkpoint}", "data.seed=11"],
         r"the checkpoint's vocabulary differs from the one built from the training data \(checkpoint vs data: "
         r"[\d,]+ words vs [\d,]+ words; first difference at id \d+: 'w\d+' vs 'w\d+'\)", "ValueError",
         files={"checkpoint": "checkpoint"}),
    Case("checkpoint: non-finite values", ["ckpt_path={nan}"],
         r"checkpoint .*nan.ckpt holds non-finite values: lstm.0.weight_hh_l0 has 1 NaN or infinite value\(s\) of "
         r"1,024; the file is damaged or was saved after training diverged: resume from an earlier checkpoint",
         "CheckpointError", files={"nan": "nan_checkpoint"}),
    Case("checkpoint: damaged, every value finite", ["ckpt_path={damaged}"],
         r"checkpoint .*damaged.ckpt is damaged: \d+ of its \d+ tensors differ from the CRC-32 checksums recorded when "
         r"it was written: [\w.]+(, [\w.' ]+)*( and \d+ more)?; it was damaged after it was written \(on disk or in a "
         r"copy\): resume from an earlier checkpoint, or from another copy of this one", "CheckpointError",
         files={"damaged": "damaged_checkpoint"}),
    Case("checkpoint: truncated, on two processes", ["layout=pp2", "ckpt_path={truncated}"],
         r"cannot be read: it is truncated or not a checkpoint", "CheckpointError",
         files={"truncated": "truncated_checkpoint"}),
]


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory) -> Path:
    """A real checkpoint of the tiny synthetic run (one process)."""
    from hydra import compose, initialize_config_dir

    directory = tmp_path_factory.mktemp("good")
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=[f"paths.output_dir={directory}", *TINY,
                                                      *SYNTHETIC, ONE_PROCESS, "evaluate=false"])
    return Path(train(cfg)["checkpoint"])


def _make_file(kind: str, directory: Path, good: Path) -> Path:
    if kind == "checkpoint":
        return good
    if kind == "truncated_checkpoint":
        path = directory / "truncated.ckpt"
        data = good.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        return path
    if kind == "nan_checkpoint":  # saved after training diverged: a NaN in a recurrent weight, its checksums its own
        path = directory / "nan.ckpt"
        checkpoint = torch.load(good, weights_only=False)
        checkpoint["state_dict"]["lstm.0.weight_hh_l0"][3, 5] = float("nan")
        torch.save(with_record(checkpoint), path)
        return path
    if kind == "damaged_checkpoint":  # 50 flipped bits, every value still finite: a disk or a copy damaged it
        path = directory / "damaged.ckpt"
        shutil.copy(good, path)
        damage_tensor_bytes(path)
        return path
    if kind == "long_line":  # 300 lines of 5 to 30 words, and line 8 of 100,000
        path = directory / "long.txt"
        words = [f"w{i}" for i in range(50)]
        lines = [" ".join(words[(i * 7 + j) % 50] for j in range(5 + i % 26)) for i in range(300)]
        lines.insert(7, " ".join(words[j % 50] for j in range(100_000)))
        path.write_text("\n".join(lines) + "\n")
        return path
    if kind == "text":
        path = directory / "text.txt"
        path.write_text("the cat sat on the mat\n" * 20)
        return path
    if kind == "empty":
        path = directory / "empty.txt"
        path.write_text("")
        return path
    if kind == "binary":
        path = directory / "binary.bin"
        path.write_bytes(bytes(range(256)) * 4)
        return path
    if kind == "ptb_dir_without_test":
        path = directory / "ptb_partial"
        path.mkdir()
        for split in ("train", "valid"):
            (path / f"ptb.{split}.txt").write_text("a b c\n" * 10)
        return path
    raise ValueError(kind)


def _refuse_to_launch(*args, **kwargs):
    raise AssertionError("this case launched rank processes instead of failing first")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.processes
def test_bad_input_fails_clearly_and_keeps_the_checkpoint(case, tmp_path, good_checkpoint, compose_train,
                                                          monkeypatch):
    torch.set_num_threads(1)
    files = {name: _make_file(kind, tmp_path, good_checkpoint) for name, kind in case.files.items()}
    overrides = [o.format(**files) for o in case.overrides]
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    shutil.copy(good_checkpoint, checkpoints / "last.ckpt")
    before = (checkpoints / "last.ckpt").read_bytes()
    monkeypatch.setattr(launcher.JobLauncher, "_call_children_scripts", _refuse_to_launch)
    with pytest.raises(Exception) as caught:
        train(compose_train(*_base(overrides), *overrides))
    names = {cls.__name__ for cls in type(caught.value).__mro__}
    assert case.error in names, f"{type(caught.value).__name__}: {caught.value}"
    assert re.search(case.message, str(caught.value)), str(caught.value)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["last.ckpt"]
    assert (checkpoints / "last.ckpt").read_bytes() == before


@pytest.mark.timeout(90)
@pytest.mark.processes
def test_train_py_on_two_processes_fails_before_starting_the_second(tmp_path):
    """What used to fail on every rank after launching (too few sentences for the replicas) now fails in the one
    process `python train.py layout=dp2` starts with: no rank is spawned, no process group formed."""
    case = next(c for c in CASES if c.id == "data: fewer sentences than replicas")
    args = [sys.executable, "train.py", *_base(case.overrides), *case.overrides,
            f"hydra.run.dir={tmp_path}/run"]
    result, leftovers = run_command_and_leftovers(args, timeout=80)
    assert result.returncode != 0 and leftovers == [], result.stdout[-3000:]
    assert len(re.findall(case.message, result.stdout)) == 1, result.stdout[-3000:]
    assert "Initializing distributed" not in result.stdout
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_matrix_covers_every_kind_of_input_and_the_docs_list_every_case():
    kinds = {case.id.split(":")[0] for case in CASES}
    assert kinds == {"model", "layout", "partition", "buckets", "corpus", "data", "checkpoint"}
    assert len(CASES) >= 30 and len({c.id for c in CASES}) == len(CASES)
    table = (ROOT / "docs" / "reliability.md").read_text().split("## The bad-input matrix", 1)[1]
    listed = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ") and "---" not in line]
    assert sorted(re.sub(r" \(2 processes\)$", "", c) for c in listed[1:]) == sorted(c.id for c in CASES)


# ----- every option that takes a number ----------------------------------------------------------------------------
#: The config groups ``train.py`` builds a run from whose options docs/configuration.md documents (the trainer's are
#: Lightning's, checked by its Trainer).
GROUPS = ("data", "buckets", "model", "layout", "schedule", "partition", "strategy", "callbacks")
#: Options that take a number but are null or 'auto' in the default config (the walk finds those set to a number).
NUMBERS_NOT_SET_BY_DEFAULT = ("data.max_tokens", "data.eval_batch_size", "buckets.max_length", "layout.stages_per_rank",
                              "layout.pipeline_parallel_size", "schedule.n_microbatches", "partition.stage_speeds",
                              "strategy.num_threads", "strategy.memory_per_process", "callbacks.divergence.patience")


def _number_options(cfg: DictConfig) -> dict[str, str]:
    """Every option of :data:`GROUPS` (and ``seed``) that takes a number or a list of numbers, with a bad value."""
    found = {"seed": "-3"}

    def walk(node: DictConfig, path: str) -> None:
        for key in node:
            if str(key).startswith("_") or OmegaConf.is_interpolation(node, key):
                continue  # an interpolation's value is given, and checked, where it points
            value, name = node[key], f"{path}.{key}"
            if isinstance(value, DictConfig):
                walk(value, name)
            elif isinstance(value, ListConfig) and value and all(_is_number(v) for v in value):
                found[name] = "[-3]"
            elif _is_number(value):
                found[name] = "-3"

    for group in GROUPS:
        walk(cfg[group], group)
    return {**found, **{name: "[-3]" if name.endswith("speeds") else "-3" for name in NUMBERS_NOT_SET_BY_DEFAULT}}


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class _FirstTensor(TorchFunctionMode):
    """Notes the first torch call that built a tensor holding any element (the model's parameters on the meta device
    count; Lightning's empty probe of the default device does not)."""

    def __init__(self) -> None:
        super().__init__()
        self.first: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.first is None and isinstance(out, torch.Tensor) and out.numel() > 0:
            self.first = getattr(func, "__name__", repr(func))
        return out


@pytest.mark.timeout(150)
def test_every_option_that_takes_a_number_refuses_a_bad_one_by_name_before_the_first_tensor(compose_train,
                                                                                            monkeypatch):
    """``data.batch_size=-3`` built a tensor of -3 rows (torch's ``zeros: Dimension size must be non-negative``)
    before the data module checked it, and ``model.optimizer.lr=-3`` was refused by torch only after launching: every
    option of the documented groups that takes a number must refuse -3 naming itself, before any tensor is built."""
    torch.set_num_threads(1)
    monkeypatch.setattr(launcher.JobLauncher, "_call_children_scripts", _refuse_to_launch)
    options = _number_options(compose_train(*TINY, *SYNTHETIC))
    assert len(options) >= 30 and {"data.batch_size", "model.optimizer.lr", "buckets.num_buckets"} <= set(options)
    wrong = []
    for name, bad in options.items():
        watch = _FirstTensor()
        try:
            with watch:
                train(compose_train(*TINY, *SYNTHETIC, f"{name}={bad}"))
        except Exception as error:  # noqa: BLE001  (each option's own error)
            if name.rsplit(".", 1)[-1] not in str(error) or watch.first is not None:
                wrong.append(f"{name}={bad}: {type(error).__name__}: {str(error)[:160]} (first tensor: {watch.first})")
        else:
            wrong.append(f"{name}={bad}: accepted")
    assert not wrong, "\n".join(wrong)

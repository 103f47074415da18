"""Shared test helpers: tiny models and batches, fixed data modules, error measures, the PTB location, and
running commands under a deadline (functions on several processes: :func:`run_ranks`, forked from a server that
imported torch once).

Test modules import from here (and get fixtures from ``conftest.py``); they never import each other.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import signal
import struct
import subprocess
import zipfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader

from lightning_mp_lstm import LSTMLanguageModel
from lightning_mp_lstm.base import testing
from lightning_mp_lstm.base.testing import PTB_ENV, free_port  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
#: Vocabulary size of the hand-made batches.
VOCAB = 37
#: ``train.py`` overrides for a run of a few seconds: the tiny model on a small synthetic corpus.
TINY_RUN = ["trainer=ci", "data.batch_size=16", "model.hidden_size=16", "model.embedding_dim=16"]
#: One process (``python train.py`` alone runs a 2-stage pipeline): for runs inside the test process.
ONE_PROCESS = "layout=single"
#: The small synthetic corpus's sizes (only with ``data=synthetic``, the default).
SMALL_SYNTHETIC = ["data.synthetic.num_train=300", "data.synthetic.num_valid=40", "data.synthetic.num_test=40"]
#: What the user sees in each case of ``docs/reliability.md``'s table "Stopped, preempted, stuck or diverging": the
#: tests search what they get for these, and ``tests/test_docs.py`` checks that the table has a row for every case
#: whose "what the user sees" cell holds a match.
RELIABILITY_MESSAGES = {
    "stopped by a signal": r"mp_lstm: stopped by SIGTERM at global step \d+ \(epoch \d+, after batch_idx \d+ of "
                           r"\d+\); saved a checkpoint to \S+last\.ckpt; resume from it with ckpt_path=\S+last\.ckpt",
    "stopped by a signal, train.py's last line": r"Resume with: python train\.py( \S+)* hydra\.run\.dir=\S+ "
                                                 r"ckpt_path=\S+last\.ckpt",
    "Ctrl-C twice": r"mp_lstm: SIGINT again: ended every process at once; (the stop's checkpoint of global step \d+ "
                    r"was written to \S+last\.ckpt|the stop's checkpoint was not written; \S+ holds the last "
                    r"checkpoint written before it|no checkpoint of this run was written)",
    "a port another run holds": r"MASTER_PORT=\d+: port \d+ is already in use on this machine: another run \(or "
                                r"another program\) listens on it, so this run's rank 0 cannot\. Give this run a free "
                                r"port \(MASTER_PORT=<another port>\), or unset MASTER_PORT and a free one is chosen",
    "a failure without a message": r"mp_lstm: rank 0 stopped because it lost a peer: rank 1 \(pid \d+ on \S+\) failed "
                                   r"with RuntimeError \(no message\) at \w+\.py:\d+ in \w+\. Transport error: ",
    "a rank stopped (SIGSTOP)": r"mp_lstm: rank 0 stopped because it lost a peer: rank 1 \(pid \d+ on \S+\) is "
                                r"stopped \(SIGSTOP, Ctrl-Z or a debugger\) and does not answer\. Transport error: ",
    "rank 0 killed": r"mp_lstm: rank 1 stopped because it lost a peer: rank 0 \(pid \d+ on [^)]+\) is no longer "
                     r"running \(killed or crashed\)\. Transport error: ",
    "diverging: above max_loss": r"mp_lstm: training diverged at global step \d+ \(epoch \d+, batch_idx \d+\): "
                                 r"train/loss is [\d.e+]+, above max_loss=100\. Lower the learning rate or clip "
                                 r"gradients \(gradient_clip_val\); checkpoints saved before this step hold the "
                                 r"weights from before it",
    "diverging: rising": r"mp_lstm: training diverged at global step \d+ \(epoch \d+, batch_idx \d+\): train/loss "
                         r"rose at each of the last 4 steps \(patience=4\): [\d.]+( -> [\d.]+){4}\. Lower the "
                         r"learning rate",
    "a 100,000-token line, buckets=auto": r"1 of 301 sentences are longer than the largest bucket \(\d+ tokens\) and "
                                          r"were split into pieces",
    "runs started together": r"\d{2}-\d{2}-\d{2}\.\d{6}_\d+",
}


# ----- the documentation's examples, as modules -------------------------------------------------------------------
def load_example(name: str) -> ModuleType:
    """``docs/examples/<name>.py`` loaded as a module (the docs' examples are scripts, not a package)."""
    path = ROOT / "docs" / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"docs_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class TimeFirstStream(pl.LightningDataModule):
    """word_language_model's ``batchify`` + ``get_batch`` of a learnable token stream (mostly the next token of a
    fixed cycle): ``rows`` columns, ``bptt``-long time-first windows with flat targets, ``steps`` batches.
    ``time_first=False`` gives the same windows batch first, targets ``(B, T)``."""

    def __init__(self, vocab: int = 29, rows: int = 7, bptt: int = 6, steps: int = 4, time_first: bool = True
                 ) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(5)
        cycle = torch.randperm(vocab, generator=generator)
        positions = torch.arange(rows * (steps * bptt + 1))
        noise = torch.randint(0, vocab, positions.shape, generator=generator)
        stream = torch.where(torch.rand(positions.shape, generator=generator) < 0.8, cycle[positions % vocab], noise)
        data = stream.view(rows, -1).t().contiguous()  # (T, B)
        windows = [(data[i:i + bptt], data[i + 1:i + 1 + bptt]) for i in range(0, steps * bptt, bptt)]
        self.batches = [(x, y.reshape(-1)) if time_first else (x.t().contiguous(), y.t().contiguous())
                        for x, y in windows]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.batches, batch_size=None)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.batches[:2], batch_size=None)


# ----- data ------------------------------------------------------------------------------------------------
def ptb_dir() -> Path:
    """The directory with ``ptb.valid.txt`` and ``ptb.test.txt``: ``$LIGHTNING_MP_LSTM_PTB_DIR``, else
    the repository's ``data/ptb``. A test that needs them fails, never skips: a clone holds them."""
    return testing.ptb_dir(ROOT)


def lm_batches(rows: int, lengths: Iterable[int], seed: int = 1, vocab: int = VOCAB) -> list[tuple[torch.Tensor, ...]]:
    """Bucketed, padded ``(inputs, targets)`` batches: each row has a random number of real tokens, the rest
    is padding 0; the first row of every batch is full."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for length in lengths:
        tokens = torch.randint(1, vocab, (rows, length + 1), generator=g)
        real = torch.randint(1, length + 1, (rows,), generator=g)
        real[0] = length
        mask = torch.arange(length)[None, :] < real[:, None]
        batches.append((tokens[:, :-1] * mask, tokens[:, 1:] * mask))
    return batches


class FixedBatches(pl.LightningDataModule):
    """Fixed global batches; each data-parallel replica gets its contiguous share of every batch.

    Args:
        train_lengths: the bucket length of each training batch (one batch per entry).
        rows: global sentences per batch.
        seed: seed of the training batches.
        validate_on_train: validate on the first two training batches (a loss that can fall), instead of two
            batches of random tokens (nothing to learn).
    """

    bucket_lengths = [5, 9]
    shards_data_parallel = True  # each replica's loader yields its own rows

    def __init__(self, train_lengths: Iterable[int] = (5, 9, 7, 5, 9), rows: int = 8, seed: int = 3,
                 validate_on_train: bool = False) -> None:
        super().__init__()
        self.batch_size = rows  # global sentences per batch, as LMDataModule exposes it
        self.train = lm_batches(rows, train_lengths, seed=seed)
        self.val = self.train[:2] if validate_on_train else lm_batches(rows, (6, 9), seed=4)

    @property
    def mean_padded_length(self) -> float:
        """Mean length of the training batches (the contract planning reads)."""
        return sum(int(x.shape[1]) for x, _ in self.train) / len(self.train)

    def _shard(self, batches: list) -> DataLoader:
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas, rank = kwargs.get("num_replicas", 1), kwargs.get("rank", 0)
        out = []
        for x, y in batches:
            share = x.shape[0] // replicas
            out.append((x[rank * share:(rank + 1) * share], y[rank * share:(rank + 1) * share]))
        return DataLoader(out, batch_size=None)

    def train_dataloader(self) -> DataLoader:
        return self._shard(self.train)

    def val_dataloader(self) -> DataLoader:
        return self._shard(self.val)

    def test_dataloader(self) -> DataLoader:
        return self._shard(self.val)

    def predict_dataloader(self) -> DataLoader:
        return self._shard(self.val)


class GlobalBatches(FixedBatches):
    """:class:`FixedBatches` as a user's own data gives them: every replica's loader yields the whole global batch
    (the strategy takes each replica's rows)."""

    shards_data_parallel = False

    def _shard(self, batches: list) -> DataLoader:
        return DataLoader(list(batches), batch_size=None)


def replica_share(predictions: list[dict], replica: int, replicas: int) -> list[dict]:
    """Replica ``replica``'s rows of every batch of ``predictions`` (one process's), the contiguous share
    :class:`FixedBatches` gives it: what each rank of that replica predicts."""
    return [{key: value.tensor_split(replicas)[replica] for key, value in batch.items()} for batch in predictions]


def tiny_model(num_layers: int = 2, vocab: int = VOCAB, seed: int | None = 0, **kwargs: Any) -> LSTMLanguageModel:
    """The tests' LSTM language model: embedding 6, hidden 8, seeded (``torch.manual_seed``, every device's
    generator; ``seed=None``: the caller seeded)."""
    if seed is not None:
        torch.manual_seed(seed)
    return LSTMLanguageModel(vocab, **{"embedding_dim": 6, "hidden_size": 8, "num_layers": num_layers, **kwargs})


def quiet_trainer(strategy: Any, devices: int, callbacks: Iterable[pl.Callback] = (), **kwargs: Any) -> pl.Trainer:
    """A CPU Trainer without logger, checkpointing (unless a ModelCheckpoint is given), progress bar or summary."""
    callbacks = list(callbacks)
    settings = dict(logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                    enable_checkpointing=any(isinstance(c, pl.callbacks.ModelCheckpoint) for c in callbacks))
    return pl.Trainer(strategy=strategy, accelerator="cpu", devices=devices, callbacks=callbacks,
                      **{**settings, **kwargs})


class ValLosses(pl.Callback):
    """Records the validation loss after every validation epoch (not the sanity check)."""

    def __init__(self) -> None:
        self.values: list[float] = []

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.values.append(float(trainer.callback_metrics["val/loss"]))


class TrainLosses(pl.Callback):
    """Records ``(global_step, <key>)`` after every training batch: the logged loss curve."""

    def __init__(self, key: str = "train/loss") -> None:
        self.key = key
        self.values: list[tuple[int, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        self.values.append((trainer.global_step, float(trainer.callback_metrics[self.key])))


def whole(tensor: torch.Tensor) -> torch.Tensor:
    """A detached copy of ``tensor``, gathered whole when it is a sharded ``DTensor`` (a collective over its mesh)."""
    tensor = tensor.detach()
    # A replicated DTensor's full_tensor() is its local tensor itself, not a copy: a later in-place change (a hook
    # that scales the gradients after this was recorded) would reach it.
    return tensor.full_tensor().clone() if isinstance(tensor, DTensor) else tensor.clone()


class Gradients(pl.Callback):
    """Every parameter's gradient before each optimizer step (after the strategy's reductions, before clipping),
    under every name the parameter has on this process (a tied weight under both); ``gather``: sharded gradients
    gathered whole (:func:`whole`), else as this process's shard."""

    def __init__(self, gather: bool = False) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []
        self.gather = gather

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        copy = whole if self.gather else (lambda t: t.detach().clone())
        self.steps.append({n: copy(p.grad) for n, p in pl_module.named_parameters(remove_duplicate=False)
                           if p.grad is not None})


def fit_and_record(strategy: Any, devices: int, model: pl.LightningModule, data: Any, steps: int,
                   validations: int = 1) -> dict[str, Any]:
    """Fit ``model`` for ``steps`` (gradient clipping 0.5, 3 validation batches at the end), recording the loss and
    every gradient of every step, then validate ``validations`` times.

    Returns:
        ``params`` (the final parameters), ``losses``, ``grads`` (per step) and ``val`` (one loss per validation).
    """
    losses, grads = TrainLosses(), Gradients()
    trainer = quiet_trainer(strategy, devices, [losses, grads], max_steps=steps, gradient_clip_val=0.5,
                            limit_val_batches=3, val_check_interval=steps)
    trainer.fit(model, datamodule=data)
    val = [trainer.validate(model, datamodule=data, verbose=False)[0]["val/loss"] for _ in range(validations)]
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()}, "losses": losses.values,
            "grads": grads.steps, "val": val}


def evaluate_in_inference_mode(monkeypatch: pytest.MonkeyPatch | None = None) -> None:
    """Make Lightning evaluate under ``torch.inference_mode``, as it does on one device and with NCCL: in a rank
    process for good, in the test's own process through ``monkeypatch``. With a gloo group it evaluates under
    ``torch.no_grad`` instead (``lightning.pytorch.loops.utilities._no_grad_context``), so CPU ranks would never meet
    the inference tensors an evaluation makes; a fit's validation runs without inference mode everywhere."""
    import lightning.pytorch.loops.utilities as loops

    (monkeypatch or pytest.MonkeyPatch()).setattr(loops, "_distributed_is_initialized", lambda: False)


def cpu_engine(module: torch.nn.Module, layout: Any, rank: int) -> Any:
    """The pipeline engine of ``rank`` for ``module`` on ``layout``: a CPU mesh, an even partition."""
    from torch.distributed.device_mesh import init_device_mesh

    from lightning_mp_lstm.models.binding import pipeline_model
    from lightning_mp_lstm.pipeline.engine import build_engine
    from lightning_mp_lstm.pipeline.groups import ProcessGroups
    from lightning_mp_lstm.planning.layout import MESH_DIMS
    from lightning_mp_lstm.planning.partition import even_partition

    replica, pipeline_rank = layout.coordinates(rank)[:2]
    mesh = init_device_mesh("cpu", (layout.data_parallel_size, layout.pipeline_parallel_size, 1),
                            mesh_dim_names=MESH_DIMS)
    blocks = pipeline_model(module)
    return build_engine(blocks, layout, even_partition(blocks.block_names, layout.num_stages), pipeline_rank,
                        replica, ProcessGroups.of(mesh), torch.device("cpu"))


# ----- comparisons -----------------------------------------------------------------------------------------
def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` (Frobenius norms)."""
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def parameters_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Detached copies of ``model``'s parameters by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def assert_ranks_match(per_rank: list[Mapping[str, torch.Tensor]], reference: Mapping[str, torch.Tensor],
                       tol: float = 1e-5) -> None:
    """Every rank's parameters equal the reference's of the same name, and the ranks together hold them all.

    Each rank is checked on its own (replicas included), so a replica that drifted cannot hide behind another.
    """
    held: set[str] = set()
    for rank, params in enumerate(per_rank):
        assert params, f"rank {rank} holds no parameters"
        for name, value in params.items():
            assert name in reference, (rank, name)
            error = rel_error(value, reference[name])
            assert error < tol, f"rank {rank} parameter {name}: relative error {error:.2e}"
        held |= set(params)
    assert held == set(reference), sorted(set(reference) ^ held)


def assert_same_training(per_rank: list[Mapping[str, Any]], reference: Mapping[str, Any], steps: int,
                         tol: float = 1e-5) -> None:
    """Every rank logged the reference's loss curve (``"losses"``: ``(global_step, loss)`` pairs) and had the
    reference's gradient of every parameter it holds before every optimizer step (``"grads"``, see
    :class:`Gradients`), within ``tol`` relative. Where the rank's results name its parameters (``"params"``), it
    has a gradient of each the reference has one of, and none of the others (a parameter the user froze); else every
    step gave it some gradient."""
    for rank, r in enumerate(per_rank):
        assert [s for s, _ in r["losses"]] == [s for s, _ in reference["losses"]] and len(r["losses"]) == steps
        for (_, loss), (_, expected) in zip(r["losses"], reference["losses"]):
            assert loss == pytest.approx(expected, rel=tol), rank
        assert len(r["grads"]) == len(reference["grads"]) == steps
        for step, (got, expected) in enumerate(zip(r["grads"], reference["grads"])):
            if "params" in r:
                held = set(r["params"])
                assert {n for n in got if n in held} == {n for n in expected if n in held}, (rank, step)
            else:
                assert got, (rank, step)
            for name, grad in got.items():
                error = rel_error(grad, expected[name])
                assert error < tol, f"rank {rank} step {step} {name}: relative error {error:.2e}"


def _split_worker(rank: int, world_size: int, fit: Any, strategy_kwargs: dict, args: tuple, kwargs: dict) -> dict:
    from lightning_mp_lstm import MPLSTMStrategy

    return fit(MPLSTMStrategy(report_after_steps=None, timeout=60, **strategy_kwargs), world_size, *args, **kwargs)


def assert_split_equals_one_process(fit: Any, processes: int, strategy_kwargs: Mapping[str, Any],
                                    reference: Mapping[str, Any], steps: int, *args: Any, timeout: float = 280,
                                    **kwargs: Any) -> list[dict]:
    """"A layout equals one process", the one way the tests say it: ``fit(MPLSTMStrategy(**strategy_kwargs),
    processes, *args, **kwargs)`` on ``processes`` ranks trained what ``reference`` (the same ``fit`` with
    ``"auto"`` on one process: the module's own ``training_step``) trained: every rank's parameters, the loss curve
    and every gradient of every step, to 1e-5 relative.

    ``fit`` must be a module-level function (it travels to the ranks by name) returning ``params``, ``losses`` and
    ``grads`` (:class:`TrainLosses`, :class:`Gradients`); the ranks' results are returned for further checks.
    """
    results = run_ranks(_split_worker, processes, fit, dict(strategy_kwargs), args, kwargs, timeout=timeout)
    assert_ranks_match([r["params"] for r in results], reference["params"])
    assert_same_training(results, reference, steps)
    return results


def assert_same_predictions(got: list[dict], expected: list[dict]) -> None:
    """Predict-step outputs equal: as many batches, every row of every batch, log-probabilities and
    ``next_token`` and the mask."""
    assert len(got) == len(expected) > 0
    for batch_got, batch_ref in zip(got, expected):
        assert set(batch_got) == {"log_probs", "next_token", "mask"}
        for key in ("log_probs", "next_token", "mask"):
            assert batch_got[key].shape == batch_ref[key].shape, key
        torch.testing.assert_close(batch_got["log_probs"], batch_ref["log_probs"], rtol=1e-5, atol=1e-6)
        assert torch.equal(batch_got["next_token"], batch_ref["next_token"])
        assert torch.equal(batch_got["mask"], batch_ref["mask"])


# ----- processes -------------------------------------------------------------------------------------------
class DictStore:
    """The part of a c10d store that :class:`~lightning_mp_lstm.base.faults.PeerDirectory` uses, in memory."""

    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def set(self, key: str, value: str) -> None:
        self.values[key] = value.encode()

    def check(self, keys: list[str]) -> bool:
        return all(k in self.values for k in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]



def run_ranks(fn: Any, world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """:func:`lightning_mp_lstm.base.testing.run_ranks` with its ranks forked from the forkserver unless
    ``start_method`` says otherwise: a rank then starts in milliseconds instead of importing torch and Lightning again
    (about 7 s for 2 ranks, 15 s for 4 on 2 cores). Forked ranks share the forkserver's random state, which launched
    processes do not: a test of what a script that never seeds does needs ``start_method="spawn"``."""
    return testing.run_ranks(fn, world_size, *args, **{"start_method": "forkserver", **kwargs})


def run_command(args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run ``args`` from the repository root in its own process group, one CPU thread per process.

    Whatever it launches (Lightning's rank processes, torchrun workers) is killed with it if it outlives
    ``timeout``; the call then raises ``TimeoutError`` with the tail of the output. Processes it leaves behind
    are killed too (:func:`run_command_and_leftovers` reports them).
    """
    return run_command_and_leftovers(args, timeout, **env)[0]


def start_command(args: list[str], **env: str) -> subprocess.Popen:
    """Start ``args`` like :func:`run_command` does, without waiting; kill it with ``os.killpg``."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    return subprocess.Popen(args, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def processes_in_group(pgid: int) -> list[int]:
    """Pids of the live (not zombie) processes of process group ``pgid`` (Linux ``/proc``)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        state, group = fields[0], int(fields[2])
        if group == pgid and state != "Z":
            pids.append(int(entry.name))
    return pids


def run_command_and_leftovers(args: list[str], timeout: float, **env: str) -> tuple[subprocess.CompletedProcess,
                                                                                     list[int]]:
    """:func:`run_command`, plus the pids of its process group still alive once it exited (the processes it
    left behind); those are then killed, so none outlives the caller."""
    proc = start_command(args, **env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(args)} did not finish in {timeout:.0f} s; output:\n{out[-4000:]}") from None
    leftovers = processes_in_group(proc.pid)
    if leftovers:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return subprocess.CompletedProcess(args, proc.returncode, out, None), leftovers


#: A ``sitecustomize`` module: registered before anything else, its exit handler runs last, just before the
#: interpreter finalizes, and prints the script and the names of the process's threads still running then.
_EXIT_PROBE = """import atexit, os, sys


def _threads_at_exit():
    names = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            pass
    script = os.path.basename(sys.argv[0]) if sys.argv else ""
    sys.stderr.write(f"threads at exit: {script} {os.getpid()} {','.join(sorted(names))}\\n")
    sys.stderr.flush()


atexit.register(_threads_at_exit)
"""


def exit_thread_probe(folder: Path) -> dict[str, str]:
    """The environment (for :func:`run_command` / :func:`start_command`) under which every Python process of a command
    prints, as its very last exit handler, ``threads at exit: <script> <pid> <thread names>`` (Linux ``/proc``);
    :func:`threads_at_exit` reads them back."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(_EXIT_PROBE)
    return {"PYTHONPATH": str(folder)}


def threads_at_exit(output: str, script: str) -> dict[int, list[str]]:
    """The threads each process of ``script`` (``train.py``) ran at its exit, by pid (:func:`exit_thread_probe`)."""
    found = {}
    for line in output.splitlines():
        if line.startswith("threads at exit: "):
            name, pid, threads = (line.split(" ", 5)[3:] + [""])[:3]
            if name == script:
                found[int(pid)] = threads.split(",") if threads else []
    return found


# ----- damaged checkpoints ---------------------------------------------------------------------------------
def _storage_ranges(path: Path) -> list[tuple[Path, int, int]]:
    """``(file, offset, length)`` of every tensor storage of a checkpoint file in torch's zip format."""
    ranges = []
    with zipfile.ZipFile(path) as archive, path.open("rb") as handle:
        for info in archive.infolist():
            if re.search(r"(^|/)data/[^/]+$", info.filename) and info.file_size >= 4:
                handle.seek(info.header_offset + 26)
                name_length, extra_length = struct.unpack("<HH", handle.read(4))
                ranges.append((path, info.header_offset + 30 + name_length + extra_length, info.file_size))
    return ranges


def _block_ranges(directory: Path) -> list[tuple[Path, int, int]]:
    """``(file, offset, length)`` of every tensor block of a sharded checkpoint directory."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    metadata = dcp.FileSystemReader(str(directory)).read_metadata()
    return [(directory / info.relative_path, info.offset, info.length)
            for index, info in metadata.storage_data.items()
            if isinstance(metadata.state_dict_metadata[index.fqn], TensorStorageMetadata) and info.length >= 4]


def damage_tensor_bytes(path: Path, count: int = 50, seed: int = 0) -> None:
    """Flip ``count`` bits of the tensor bytes of a checkpoint file, or of a sharded checkpoint directory's blocks,
    in place, each in the two low bytes of a float32 (its mantissa): every value stays finite, as after a disk or a
    copy damaged it."""
    places = _block_ranges(path) if path.is_dir() else _storage_ranges(path)
    rng = random.Random(seed)
    for _ in range(count):
        file, offset, length = rng.choice(places)
        data = bytearray(file.read_bytes())
        data[offset + 4 * rng.randrange(length // 4) + rng.randrange(2)] ^= 1 << rng.randrange(8)
        file.write_bytes(bytes(data))


# ----- what a run left where -------------------------------------------------------------------------------
class RecordBlockDevices(pl.Callback):
    """Records on which devices each block's parameters are when the Trainer sets up (before the strategy's
    ``setup``) and when training starts, with the strategy's root device, and writes them as JSON to ``path``
    (one file per global rank: ``<stem>.rank<r>.json`` beside ``path``) at the end of ``fit``.

    Add it to a ``train.py`` run from the command line::

        +callbacks.devices._target_=tests.helpers.RecordBlockDevices +callbacks.devices.path=<file>
    """

    def __init__(self, path: str) -> None:
        self.path = Path(path)
        self.seen: dict[str, Any] = {}
        self.block_names: list[str] = []

    def _blocks(self, pl_module: pl.LightningModule) -> dict[str, list[str]]:
        blocks: dict[str, set[str]] = {}
        for name, param in pl_module.named_parameters():
            block = next((b for b in self.block_names if name.startswith(f"{b}.")), name)
            blocks.setdefault(block, set()).add(str(param.device))
        return {block: sorted(devices) for block, devices in blocks.items()}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        from lightning_mp_lstm.models.binding import pipeline_model

        if not self.block_names:  # before the strategy prunes the model
            self.block_names = list(pipeline_model(pl_module).block_names)
        self.seen.setdefault("setup", self._blocks(pl_module))

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["train_start"] = self._blocks(pl_module)
        self.seen["root_device"] = str(trainer.strategy.root_device)
        self.seen["strategy"] = type(trainer.strategy).__name__
        self.seen["world_size"] = trainer.world_size

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        import json  # (appended helper: its own import)

        self.seen["fit_end"] = self._blocks(pl_module)
        target = self.path.with_name(f"{self.path.stem}.rank{trainer.global_rank}.json")
        target.write_text(json.dumps(self.seen, indent=1, sort_keys=True))

"""CPU guards for GPU hazards that need whole runs (#19). Each run (single process, pp2, dp2, tp2, dp2 x pp2) fits,
validates, predicts and saves a one-file checkpoint of a tiny model on gloo, instrumented. The runs with the same
number of processes share one set of ranks (pp2, dp2 and tp2 one after another on the same two), started once under a
deadline that kills them:

* **tensor-factory tripwire**: a ``TorchFunctionMode`` records every ``torch.zeros/ones/empty/full/tensor/arange/
  rand*/...`` call made by library code (a frame under ``lightning_mp_lstm/``) without ``device=``: on a GPU that
  tensor would land on the CPU (a device mismatch, or a silent host round trip). A few sites make CPU tensors on
  purpose (:data:`INTENDED_CPU`, and the data sets under ``data/``);
* **collective order** (pp2, dp2, tp2, dp2 x pp2): the ranks run with ``TORCH_DISTRIBUTED_DEBUG=DETAIL``, set in
  each rank before its process group starts; torch then checks that every rank issues the same collectives in the
  same order with the same shapes and dtypes, and raises on a mismatch that gloo would tolerate and NCCL would hang
  or corrupt on;
* **object traffic**: the object groups are made as under an NCCL default group (``dist.get_backend`` mocked to say
  nccl while ``faults.setup_object_group`` runs, so a separate gloo group exists), and every pickled-object call
  (``all_gather_object``, ``broadcast_object_list``, ``send_object_list``, ``recv_object_list``) is recorded with
  its group and who asked: the library's must use the gloo object groups, never a training group;
* **mesh timeouts**: every mesh group that communicates has the strategy's timeout;
* **groups made once**: a second ``fit`` (pp2 with tied weights across its stages), ``validate``, ``predict`` and a
  save make no process group;
* **sends apart from collectives**: after the dp2 x pp2 run, a checkpoint gathered on rank 0 (three receives, one
  send per other rank) leaves the object group's collectives in step under DETAIL.

The in-process guards are in ``tests/test_device_guards.py``; what needs a GPU is in ``tests/test_gpu.py``.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

import lightning_mp_lstm
from lightning_mp_lstm import MPLSTMStrategy
from lightning_mp_lstm.base import faults
from lightning_mp_lstm.planning.layout import MESH_DIMS
from lightning_mp_lstm.strategy import pipeline_setup
from lightning_mp_lstm.timeline import PipelineTimeline
from tests.helpers import FixedBatches, GlobalBatches, run_ranks, tiny_model

#: Every test here starts processes: the fast tier (-m "not processes") leaves the module out.
pytestmark = pytest.mark.processes

LIBRARY = Path(lightning_mp_lstm.__file__).resolve().parent
TORCH = Path(torch.__file__).resolve().parent
TIMEOUT = 60.0  # the strategy's process-group timeout, seconds

#: Tensor factories that put a tensor on the default (CPU) device unless given ``device=``.
FACTORIES = (torch.zeros, torch.ones, torch.empty, torch.full, torch.tensor, torch.arange, torch.range,
             torch.linspace, torch.logspace, torch.eye, torch.empty_strided, torch.scalar_tensor, torch.rand,
             torch.randn, torch.randint, torch.randperm, torch.normal, torch.bernoulli)
#: Library code that makes CPU tensors on purpose: (path under lightning_mp_lstm/, function) -> why. Everything under
#: ``data/`` is intended too: data sets are built on the CPU and Lightning moves the batches.
INTENDED_CPU = {
    ("models/lstm_language_model.py", "_init_block"):
        "a block's initial values, drawn from its own CPU generator (the same on every device and layout), then "
        "copied into the parameters on their device",
    ("models/metrics.py", "__init__"):
        "torchmetrics states, moved with their metric (.to(loss.device)) before any update",
}


def _library_path(filename: str) -> str | None:
    """``filename`` relative to the library, or ``None`` outside it."""
    try:
        return Path(filename).resolve().relative_to(LIBRARY).as_posix()
    except ValueError:
        return None


class DeviceTripwire(TorchFunctionMode):
    """Records tensor factories called from library code without ``device=`` (the intended CPU sites excepted)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            caller = sys._getframe(1)  # the factory's caller (torch calls this mode from C)
            where = _library_path(caller.f_code.co_filename)
            if where is not None and not where.startswith("data/") \
                    and (where, caller.f_code.co_name) not in INTENDED_CPU:
                self.found.append(f"{where}:{caller.f_lineno} ({caller.f_code.co_name}): torch.{func.__name__} "
                                  "without device=")
        return func(*args, **kwargs)


class ObjectTraffic:
    """Records every pickled-object call: its group (the object groups, or which other), where it was made and, for a
    call made by the library, who asked."""

    NAMES = ("all_gather_object", "broadcast_object_list", "send_object_list", "recv_object_list")

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str]] = []
        self._saved: dict[str, Any] = {}

    def __enter__(self) -> ObjectTraffic:
        for name in self.NAMES:
            self._saved[name] = original = getattr(dist, name)
            setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)

    def _wrap(self, name: str, original: Any) -> Any:
        def recorded(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            if group is not None and group is faults.object_group():
                kind = "object group"
            elif group is not None and group is faults.point_to_point_group():
                kind = "point-to-point object group"
            else:
                kind = f"other group ({'default' if group is None else dist.get_process_group_ranks(group)})"
            self.calls.append((name, kind, _asker(sys._getframe(1))))
            return original(*args, **kwargs)
        return recorded


class NewGroups:
    """Records every ``dist.new_group`` call (its ranks, and who asked) while active."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, str]] = []
        self._saved: Any = None

    def __enter__(self) -> NewGroups:
        self._saved = original = dist.new_group

        def recorded(*args: Any, **kwargs: Any) -> Any:
            self.calls.append((kwargs.get("ranks", args[0] if args else None), _asker(sys._getframe(1))))
            return original(*args, **kwargs)

        dist.new_group = recorded
        return self

    def __exit__(self, *exc: object) -> None:
        dist.new_group = self._saved


def _asker(frame: Any) -> str:
    """Who made an object call: torch's own file when torch made it, else the first library frame outside
    ``faults.py`` (the caller of ``faults.gather``, ``result_from``...)."""
    path = Path(frame.f_code.co_filename).resolve()
    if path.is_relative_to(TORCH):
        return f"torch/{path.relative_to(TORCH).as_posix()}"
    while frame is not None:
        where = _library_path(frame.f_code.co_filename)
        if where is not None and where != "base/faults.py":
            return f"{where}:{frame.f_code.co_name}"
        frame = frame.f_back
    return str(path)


def _setup_object_group_as_under_nccl() -> None:
    """``faults.setup_object_group`` as with an NCCL default group: the object collectives get a gloo group of their
    own, apart from the default group (which would be NCCL)."""
    get_backend = dist.get_backend
    dist.get_backend = lambda group=None: "nccl"
    try:
        faults.setup_object_group()
    finally:
        dist.get_backend = get_backend


def _mesh_timeouts(mesh: Any) -> dict[str, tuple[int, float]]:
    """Every mesh dimension's group size and timeout (seconds)."""
    out = {}
    for name in MESH_DIMS:
        group = mesh[name].get_group()
        backend = group._get_backend(torch.device("cpu"))
        backend = getattr(backend, "wrapped_pg", backend)  # under DETAIL: torch's checking wrapper
        out[name] = (group.size(), backend.options._timeout.total_seconds())
    return out


#: The runs: name -> (processes, strategy options). Each also records a timeline step and measures its stages after one
#: step (report_after_steps=1). Every multi-process run is under TORCH_DISTRIBUTED_DEBUG=DETAIL.
RUNS: dict[str, tuple[int, dict[str, Any]]] = {
    "single": (1, dict(pipeline_parallel_size=1, partition="balanced", n_microbatches="auto")),
    "pp2": (2, dict(pipeline_parallel_size=2, partition="balanced", n_microbatches=2)),
    "dp2": (2, dict(data_parallel_size=2, pipeline_parallel_size=1)),
    "tp2": (2, dict(tensor_parallel_size=2, pipeline_parallel_size=1, n_microbatches=2)),
    "dp2xpp2": (4, dict(data_parallel_size=2, pipeline_parallel_size=2, schedule="GPipe", n_microbatches=2)),
}
#: Model options of a run (default: the tiny model): pp2's embedding and decoder share their weight across its two
#: stages, so the run has a tied-weight process group.
MODELS: dict[str, dict[str, Any]] = {"pp2": dict(embedding_dim=8, hidden_size=8, tie_weights=True)}
DEADLINE = 150.0  # seconds for all the runs of one set of processes; ranks still alive then are killed


def _run(name: str, world_size: int, directory: str) -> dict[str, Any]:
    """One instrumented run on this rank (or in this process): fit 2 steps, validate, predict, save."""
    options = RUNS[name][1]
    pipeline_setup.setup_object_group = _setup_object_group_as_under_nccl
    tripwire, traffic = DeviceTripwire(), ObjectTraffic()
    strategy = MPLSTMStrategy(report_after_steps=1, timeout=TIMEOUT, **options)
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=world_size, max_steps=2, limit_val_batches=1,
                         limit_predict_batches=1, num_sanity_val_steps=0, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False,
                         callbacks=[PipelineTimeline(steps=[1], directory=str(Path(directory, name)))])
    with tripwire, traffic:
        with trainer.init_module(empty_init=True):  # on the meta device: the strategy materializes each rank's blocks
            model = tiny_model(vocab=38, **MODELS.get(name, {}))  # 38: tensor parallelism needs an even vocabulary
        data = FixedBatches()
        trainer.fit(model, datamodule=data)
        with NewGroups() as later:  # every group exists after the first fit
            trainer.fit(model, datamodule=data)  # max_steps reached: sets up again, trains nothing
            trainer.validate(model, datamodule=data, verbose=False)
            predictions = trainer.predict(model, datamodule=GlobalBatches())  # every replica gathers the others' rows
            trainer.save_checkpoint(Path(directory) / f"{name}.ckpt")
    result = {"tripwire": tripwire.found, "objects": traffic.calls, "steps": trainer.global_step,
              "later_groups": later.calls, "tied_groups": len(strategy.engine.tied.shared),
              "predicted_rows": int(predictions[0]["mask"].shape[0]),
              "debug_level": str(dist.get_debug_level()) if dist.is_initialized() else None,
              "checking_wrapper": dist.is_initialized() and type(
                  dist.group.WORLD._get_backend(torch.device("cpu"))).__name__ == "_ProcessGroupWrapper",
              "mesh": _mesh_timeouts(strategy.device_mesh) if world_size > 1 else {}}
    strategy.shutdown()
    return result


def _run_on_ranks(rank: int, world_size: int, names: list[str], directory: str) -> dict[str, dict[str, Any]]:
    """The runs ``names`` one after another on the same processes (one start, one import of torch and Lightning per
    rank): the first run's strategy starts the default process group under DETAIL, the next ones reuse it."""
    warnings.filterwarnings("ignore")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    dist.set_debug_level_from_env()  # torch read the variable when it was imported
    results = {name: _run(name, world_size, directory) for name in names}
    if world_size > 2:  # rank 0 receives more often than any other rank sends
        results[names[-1]]["gather_then_collectives"] = _gather_then_collectives(rank)
    return results


_RESULTS: dict[str, list[dict[str, Any]]] = {}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory):
    """``runs(name)``: every rank's result of that run. The runs of one process count are made together, once per
    module, on one set of processes under a deadline."""
    def get(name: str) -> list[dict[str, Any]]:
        if name not in _RESULTS:
            world = RUNS[name][0]
            directory = str(tmp_path_factory.mktemp(f"world{world}"))
            names = [other for other, (size, _) in RUNS.items() if size == world]
            if world == 1:
                threads = torch.get_num_threads()
                setup = pipeline_setup.setup_object_group
                try:
                    torch.set_num_threads(1)
                    per_name = {other: [_run(other, 1, directory)] for other in names}
                finally:
                    pipeline_setup.setup_object_group, _ = setup, torch.set_num_threads(threads)
            else:
                per_rank = run_ranks(_run_on_ranks, world, names, directory, timeout=DEADLINE)
                per_name = {other: [result[other] for result in per_rank] for other in names}
            _RESULTS.update(per_name)
        return _RESULTS[name]
    yield get
    _RESULTS.clear()


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", list(RUNS))
def test_library_code_makes_no_tensor_without_a_device(runs, name):
    for rank, result in enumerate(runs(name)):
        assert result["steps"] == 2, rank
        assert result["tripwire"] == [], f"rank {rank}: " + "; ".join(result["tripwire"])


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", [name for name, (world, _) in RUNS.items() if world > 1])
def test_every_rank_issues_the_same_collectives_under_torch_distributed_debug_detail(runs, name):
    """The run completing is the check: with DETAIL, torch compares every collective's order, shapes and dtypes across
    the ranks of its group and raises on the first mismatch."""
    for rank, result in enumerate(runs(name)):
        assert result["debug_level"] == "DebugLevel.DETAIL" and result["checking_wrapper"], rank
        assert result["steps"] == 2 and result["predicted_rows"] == 8, rank


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", [name for name, (world, _) in RUNS.items() if world > 1])
def test_pickled_objects_travel_on_the_gloo_object_groups_only(runs, name):
    """Under NCCL a pickle sent through a training group is staged in GPU memory through NCCL communicators; the
    library sends every object through the gloo groups made once. torch's pipelining sends its stages' shape
    metadata on the pipeline group itself (what it is built for); nothing else may use another group."""
    expected = {"plan", "report", "checkpoint/formats.py:save", "gather_to_rank_zero", "timeline"}
    if "dp2" in name:
        expected.add("pipeline/predictions.py:gather_replicas")
    for rank, result in enumerate(runs(name)):
        wrong = [call for call in result["objects"] if not call[1].endswith("object group")
                 and not call[2].startswith("torch/distributed/pipelining/")]
        assert wrong == [], f"rank {rank}: {wrong}"
        askers = {asker for _, _, asker in result["objects"]}
        for who in expected:  # the run did exercise every path that sends objects
            assert any(who in asker for asker in askers), (rank, who, sorted(askers))


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", [name for name, (world, _) in RUNS.items() if world > 1])
def test_every_mesh_group_that_communicates_has_the_strategy_timeout(runs, name):
    for rank, result in enumerate(runs(name)):
        sizes = {dim: size for dim, (size, _) in result["mesh"].items()}
        assert sizes == dict(zip(MESH_DIMS, _mesh_shape(RUNS[name][1]), strict=True)), rank
        for dim, (size, seconds) in result["mesh"].items():
            if size > 1:
                assert seconds == TIMEOUT, (rank, dim, seconds)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", [name for name, (world, _) in RUNS.items() if world > 1])
def test_no_process_group_is_made_after_the_first_fit(runs, name):
    """On NCCL every new group splits communicators that are never freed: the mesh, the object groups and the tied
    weights' groups are made once per strategy, not again by a second ``fit``, ``validate``, ``predict`` or a save."""
    for rank, result in enumerate(runs(name)):
        assert result["later_groups"] == [], (rank, result["later_groups"])
    if name == "pp2":
        assert [result["tied_groups"] for result in runs(name)] == [1, 1]  # the embedding's and decoder's copies


def _mesh_shape(options: dict[str, Any]) -> tuple[int, int, int]:
    return (options.get("data_parallel_size", 1), options.get("pipeline_parallel_size", 1),
            options.get("tensor_parallel_size", 1))


# ----- sends and receives do not desynchronize the object group's collectives --------------------------------------
def _gather_then_collectives(rank: int) -> list[Any]:
    """A checkpoint gathered on rank 0, then collectives on the object group, on the groups the last run made."""
    from lightning_mp_lstm import checkpoint

    parts = checkpoint.gather_to_rank_zero({f"block.{rank}": torch.full((2,), float(rank))})  # rank 0 receives 3 times
    shared = faults.result_from(0, lambda: "written")  # a collective on the object group right after
    everyone = faults.gather(lambda: rank)
    return [None if parts is None else sorted(k for part in parts for k in part), shared, everyone]


@pytest.mark.timeout(200)
def test_a_checkpoint_gather_leaves_the_object_group_in_step(runs):
    """gloo counts sends and receives in a group's sequence number: were the checkpoint gathered over the object
    group, rank 0 (three receives) would run the next collective under another sequence number than the other ranks
    (one send each), and DETAIL would report a mismatch. Run on the four ranks of dp2 x pp2, after its run."""
    results = [result["gather_then_collectives"] for result in runs("dp2xpp2")]
    assert results[0] == [[f"block.{rank}" for rank in range(4)], "written", [0, 1, 2, 3]]
    assert results[1:] == [[None, "written", [0, 1, 2, 3]]] * 3

"""CPU-side guards for what goes wrong only on GPUs (#19), each checked without one, in this process:

* teardown leaves the model and its optimizer state where they are (no round trip to the CPU after every
  ``fit``/``validate``/``test``; Lightning's default teardown moves both);
* building or materializing a model never reseeds or restores a CUDA generator (``torch.manual_seed`` would reseed
  every one of them, ``fork_rng()`` without ``devices=[]`` would save and restore them);
* under an NCCL default group, every object collective goes to the gloo groups made once
  (``faults.setup_object_group``), never to the default group (which would stage pickles in GPU memory);
* the NCCL-only branches, with a mocked backend name or device: the barrier's device ids, the device mesh's
  timeout options (and which mesh dimensions get a group of their own), a stage's CUDA random stream;
* the stage cache (one stage + schedule, with its receive buffers, per batch shape and mode) stays bounded;
* the loss terms' receive is posted before the schedule under gloo only (NCCL would pair it with the schedule's
  first receive from the same peer: it matches point-to-point operations in the order they are issued);
* the layout advice refuses a CUDA device, saying what to use instead.

The multi-process guards (tensor-factory tripwire, ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` collective checks, the object
traffic of whole runs, the mesh groups' timeouts) are in ``tests/test_device_runs.py``; what needs a real GPU is in
``tests/test_gpu.py`` (``pytest -m gpu``).
"""

from __future__ import annotations

import types
import warnings
from collections import OrderedDict
from datetime import timedelta

import lightning.pytorch as pl
import lightning.pytorch.strategies.strategy as lightning_strategy
import pytest
import torch
import torch.distributed as dist
from torch import nn

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import LSTMBlocks, LSTMLanguageModel, MPLSTMStrategy
from lightning_mp_lstm import checkpoint as ckpt
from lightning_mp_lstm.base import faults
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.pipeline import engine as engine_module
from lightning_mp_lstm.pipeline.engine import PipelineEngine, split_model
from lightning_mp_lstm.pipeline.stages import StageRandomness
from lightning_mp_lstm.planning import advice as advice_module
from lightning_mp_lstm.planning import layout
from lightning_mp_lstm.planning.advice import advise
from lightning_mp_lstm.planning.calibration import Calibration, calibrate
from lightning_mp_lstm.planning.layout import ParallelLayout, _timeout_options
from lightning_mp_lstm.strategy import collectives
from lightning_mp_lstm.strategy import strategy as strategy_module
from tests.helpers import FixedBatches, quiet_trainer, tiny_model


# ----- the stage cache is bounded ------------------------------------------------------------------------------
def test_the_stage_cache_keeps_the_most_recently_used_shapes_only(monkeypatch):
    """Each cached stage holds its microbatches' receive buffers (GPU memory on a GPU); ragged batches, token budgets
    and three modes would otherwise add one per distinct shape for the whole run."""
    engine = PipelineEngine.__new__(PipelineEngine)  # only the cache: no model, no process group
    engine.__dict__.update(max_cached_shapes=3, _schedules=OrderedDict(), _holding=None)
    built = []
    monkeypatch.setattr(engine, "_build_schedule", lambda with_loss, **shape: built.append(with_loss) or object(),
                        raising=False)
    for rows in (8, 7, 6, 8, 5, 4):  # 8 again before it is the oldest: kept, not rebuilt
        engine._schedule(torch.Size([rows, 9]), "train")
    engine._schedule(torch.Size([8, 9]), "predict")
    assert len(built) == 6
    assert engine.cached_shapes == [(4, 9, "train"), (5, 9, "train"), (8, 9, "predict")]


# ----- teardown keeps devices --------------------------------------------------------------------------------
@pytest.mark.processes
def test_teardown_leaves_the_model_and_optimizer_state_on_their_device(monkeypatch):
    """Lightning's ``Strategy.teardown`` calls ``_optimizers_to_device(..., cpu)`` and ``lightning_module.cpu()``:
    on CUDA a full copy to the host after every Trainer call and back at the next, and tensor-parallel DTensors with
    CPU shards on a CUDA mesh. The strategy's teardown must move nothing (as Lightning's ModelParallelStrategy)."""
    state = {"inside": False, "teardowns": 0, "moves": []}
    apply, to_device, ours = torch.nn.Module._apply, lightning_strategy._optimizers_to_device, \
        strategy_module._optimizers_to_device
    teardown = MPLSTMStrategy.teardown

    def watched_apply(self, fn, *args, **kwargs):  # every .to(), .cpu(), .cuda(), .half() ends here
        if state["inside"]:
            state["moves"].append(f"{type(self).__name__} moved ({getattr(fn, '__qualname__', fn)})")
        return apply(self, fn, *args, **kwargs)

    def watched(original, where):
        def optimizers_to_device(optimizers, device):
            if state["inside"]:
                state["moves"].append(f"{where}._optimizers_to_device(..., {device})")
            return original(optimizers, device)
        return optimizers_to_device

    def watched_teardown(self):
        state["inside"], state["teardowns"] = True, state["teardowns"] + 1
        try:
            teardown(self)
        finally:
            state["inside"] = False

    monkeypatch.setattr(torch.nn.Module, "_apply", watched_apply)
    monkeypatch.setattr(lightning_strategy, "_optimizers_to_device", watched(to_device, "lightning"))
    monkeypatch.setattr(strategy_module, "_optimizers_to_device", watched(ours, "mp_lstm"))
    monkeypatch.setattr(MPLSTMStrategy, "teardown", watched_teardown)
    warnings.filterwarnings("ignore")
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, report_after_steps=None, timeout=60)
    trainer = quiet_trainer(strategy, 1, max_steps=1, limit_val_batches=1)
    model = tiny_model(optimizer="adam", lr=0.01)
    try:
        trainer.fit(model, datamodule=FixedBatches())
        trainer.validate(model, datamodule=FixedBatches(), verbose=False)
        strategy.teardown()
    finally:
        strategy.shutdown()
    assert state["teardowns"] >= 3  # after fit, after validate, and ours
    assert state["moves"] == []
    assert all(p.device == strategy.root_device for p in model.parameters())
    assert all(t.device == strategy.root_device for s in trainer.optimizers[0].state.values() for t in s.values()
               if isinstance(t, torch.Tensor) and t.dim() > 0)


# ----- no CUDA reseeding while building --------------------------------------------------------------------------
def _watch_cuda_generators(monkeypatch) -> list[str]:
    """Record every call that would reseed or restore a CUDA generator. One CUDA device is made visible to
    ``fork_rng``, so a ``fork_rng()`` that forgets ``devices=[]`` saves and restores it (and is recorded)."""
    calls: list[str] = []
    for name in ("manual_seed", "manual_seed_all", "seed", "seed_all", "set_rng_state", "set_rng_state_all"):
        monkeypatch.setattr(torch.cuda, name, lambda *args, name=name, **kwargs: calls.append(name))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": torch.zeros(16, dtype=torch.uint8))
    return calls


class DeclaredLM(pl.LightningModule):
    """A user's module: a multi-layer ``nn.LSTM`` with default initial values, declared for the strategy."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Embedding(23, 6)
        self.rnn = nn.LSTM(6, 8, num_layers=3)
        self.decoder = nn.Linear(8, 23)

    def configure_pipeline(self) -> LSTMBlocks:
        return LSTMBlocks(embedding="encoder", lstm="rnn", decoder="decoder", time_first=True)


@pytest.mark.parametrize("init_range", [0.1, None])
def test_building_and_materializing_a_model_never_touches_a_cuda_generator(monkeypatch, init_range):
    torch.manual_seed(0)
    calls = _watch_cuda_generators(monkeypatch)
    LSTMLanguageModel(37, embedding_dim=6, hidden_size=8, num_layers=3, init_range=init_range)
    with torch.device("meta"):
        model = LSTMLanguageModel(37, embedding_dim=6, hidden_size=8, num_layers=3, init_range=init_range)
    blocks = pipeline_model(model, seed=5)
    blocks.build_block("lstm.1", torch.device("cpu"))  # planning's throw-away copies
    split_model(blocks, [["embedding", "lstm.0"], ["lstm.1", "lstm.2", "decoder"]], [1], torch.device("cpu"))
    assert not any(p.is_meta for p in model.parameters())
    assert calls == []


def test_materializing_a_declared_module_never_touches_a_cuda_generator(monkeypatch):
    torch.manual_seed(0)
    calls = _watch_cuda_generators(monkeypatch)
    with torch.device("meta"):
        module = DeclaredLM()
    blocks = pipeline_model(module, seed=5)
    blocks.build_block("rnn.2", torch.device("cpu"))
    blocks.keep_blocks(["encoder", "rnn.0", "rnn.2"])
    blocks.materialize_blocks(["encoder", "rnn.0", "rnn.2"], torch.device("cpu"))
    assert not any(p.is_meta for p in module.parameters())
    assert calls == []


# ----- object collectives go to the gloo groups ------------------------------------------------------------------
class _ObjectTraffic:
    """Stands in for torch's object collectives on a 2-rank world: records the group each call names, fills in what
    the other rank would have sent."""

    def __init__(self, monkeypatch, rank: int) -> None:
        self.calls: list[tuple[str, object]] = []
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
        monkeypatch.setattr(dist, "get_rank", lambda group=None: rank)
        monkeypatch.setattr(dist, "all_gather_object", self.all_gather_object)
        monkeypatch.setattr(dist, "broadcast_object_list", self.broadcast_object_list)
        monkeypatch.setattr(dist, "send_object_list", self.send_object_list)
        monkeypatch.setattr(dist, "recv_object_list", self.recv_object_list)

    def all_gather_object(self, out, obj, group=None):
        self.calls.append(("all_gather_object", group))
        out[:] = [obj] * len(out)

    def broadcast_object_list(self, box, src=None, group=None, **kwargs):
        self.calls.append(("broadcast_object_list", group))
        if box[0] is None:
            box[0] = ("ok", "from rank 0")

    def send_object_list(self, box, dst=None, group=None, **kwargs):
        self.calls.append(("send_object_list", group))

    def recv_object_list(self, box, src=None, group=None, **kwargs):
        self.calls.append(("recv_object_list", group))
        box[0] = {"lstm.1.weight": torch.ones(2)}


def _nccl_default_group(monkeypatch) -> tuple[object, object, list]:
    """An NCCL default group (mocked): ``setup_object_group`` makes the gloo groups (sentinels here)."""
    collective, point_to_point = object(), object()
    made: list = []
    groups = iter([collective, point_to_point])
    monkeypatch.setitem(faults._OBJECT_GROUP, "group", None)  # restored after the test
    monkeypatch.setitem(faults._OBJECT_GROUP, "point_to_point", None)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(dist, "new_group", lambda *args, **kwargs: made.append((args, kwargs)) or next(groups))
    return collective, point_to_point, made


@pytest.mark.parametrize("rank", [0, 1])
def test_under_nccl_every_object_collective_goes_to_the_gloo_groups(monkeypatch, rank):
    collective, point_to_point, made = _nccl_default_group(monkeypatch)
    traffic = _ObjectTraffic(monkeypatch, rank)
    faults.setup_object_group()
    assert made == [((), {"backend": "gloo"}), ((), {"backend": "gloo"})]
    assert faults.object_group() is collective and faults.point_to_point_group() is point_to_point

    assert faults.gather(lambda: rank) == [rank, rank]
    assert faults.everywhere(lambda: "x") == "x"
    assert faults.result_from(1, lambda: "mine") in ("mine", "from rank 0")
    assert faults.PeerDirectory.gather().rank == rank
    assert MPLSTMStrategy(pipeline_parallel_size=1).broadcast("path", src=0) in ("path", ("ok", "from rank 0"))
    parts = ckpt.gather_to_rank_zero({"lstm.0.weight": torch.zeros(2)})
    assert (parts is None) == (rank == 1)
    expected = [("all_gather_object", collective)] * 2 + [("broadcast_object_list", collective)] \
        + [("all_gather_object", collective), ("broadcast_object_list", collective),
           ("recv_object_list" if rank == 0 else "send_object_list", point_to_point)]
    assert traffic.calls == expected


def test_under_gloo_collectives_use_the_default_group_and_sends_their_own(monkeypatch):
    made = []
    monkeypatch.setitem(faults._OBJECT_GROUP, "group", "stale")
    monkeypatch.setitem(faults._OBJECT_GROUP, "point_to_point", None)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    monkeypatch.setattr(dist, "new_group", lambda *args, **kwargs: made.append(kwargs) or "p2p")
    faults.setup_object_group()
    assert made == [{"backend": "gloo"}]  # no second gloo group over every rank: the default group is one
    assert faults.object_group() is None and faults.point_to_point_group() == "p2p"


# ----- NCCL-only branches with a mocked backend or device ------------------------------------------------------
def test_the_barrier_names_this_process_device_under_nccl(monkeypatch):
    calls = []
    strategy = MPLSTMStrategy(pipeline_parallel_size=1, parallel_devices=[torch.device("cuda", 3)])
    monkeypatch.setattr(collectives, "_distributed_is_initialized", lambda: True)
    monkeypatch.setattr(dist, "barrier", lambda *args, **kwargs: calls.append((args, kwargs)))
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    strategy.barrier()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo")
    strategy.barrier()
    assert calls == [((), {"device_ids": [3]}), ((), {})]


class _NCCLOptions:
    """``torch.distributed.ProcessGroupNCCL.Options`` of a CUDA build (the CPU build has no ``ProcessGroupNCCL``)."""

    def __init__(self) -> None:
        self._timeout = None


@pytest.fixture
def nccl_build(monkeypatch):
    monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=_NCCLOptions), raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)


@pytest.mark.parametrize("shape, nccl, gloo", [
    ((1, 1, 1), [], []),
    ((1, 2, 1), [], ["pipeline_parallel"]),  # nccl: pipeline_parallel spans every rank: the default group
    ((2, 1, 1), [], ["data_parallel"]),
    ((1, 1, 2), [], ["tensor_parallel"]),
    ((2, 2, 1), ["data_parallel", "pipeline_parallel"], ["data_parallel", "pipeline_parallel"]),
    ((2, 2, 2), ["data_parallel", "pipeline_parallel", "tensor_parallel"],
     ["data_parallel", "pipeline_parallel", "tensor_parallel"]),
    ((1, 4, 2), ["pipeline_parallel", "tensor_parallel"], ["pipeline_parallel", "tensor_parallel"]),
])
def test_mesh_dimensions_get_timeout_options_only_where_torch_would_otherwise_use_its_default(
        nccl_build, shape, nccl, gloo):
    """torch makes one group per mesh dimension whatever the override. Without one, a dimension spanning every rank
    reuses the default group (already with the strategy's timeout), so on nccl an override there would only add a
    second communicator over every rank; size-1 groups never communicate. Every dimension of size > 1 ends up with
    the strategy's timeout: by its options, or as the default group."""
    timeout = timedelta(seconds=42)
    sizes = dict(zip(layout.MESH_DIMS, shape, strict=True))
    for backend, expected, kind in (("nccl", nccl, _NCCLOptions), ("gloo", gloo, dist.ProcessGroupGloo._Options)):
        override = _timeout_options(backend, timeout, sizes)
        assert sorted(override or {}) == sorted(expected), backend
        for name, (named_backend, options) in (override or {}).items():
            assert named_backend == backend and isinstance(options, kind) and options._timeout == timeout
        world = shape[0] * shape[1] * shape[2]
        for name, size in sizes.items():  # every group that communicates has the timeout
            assert size == 1 or name in expected or (backend == "nccl" and size == world), (backend, name)
    assert _timeout_options("ucc", timeout, sizes) is None


def test_the_mesh_is_built_for_the_process_device_with_those_options(monkeypatch, nccl_build):
    calls = []
    monkeypatch.setattr(layout, "init_device_mesh", lambda *args, **kwargs: calls.append((args, kwargs)))
    timeout = timedelta(seconds=9)
    ParallelLayout(data_parallel_size=2, pipeline_parallel_size=2, n_microbatches=2).build_mesh("cuda", "nccl", timeout)
    (args, kwargs), = calls
    assert args == ("cuda", (2, 2, 1)) and kwargs["mesh_dim_names"] == layout.MESH_DIMS
    assert sorted(kwargs["backend_override"]) == ["data_parallel", "pipeline_parallel"]


def test_a_stage_on_cuda_draws_dropout_from_its_own_cuda_generator(monkeypatch):
    """``StageRandomness``'s CUDA branch: a CUDA generator seeded like the stage's CPU stream, swapped in around the
    stage's work and out again (the global CUDA stream resumes where it was)."""
    real_generator = torch.Generator
    made = []

    class FakeCudaGenerator:
        def __init__(self, device) -> None:
            self.device, self.seed = torch.device(device), None

        def manual_seed(self, seed):
            self.seed = seed
            return self

        def get_state(self):
            return f"stage seeded {self.seed}"

    def generator(device=None):
        if device is not None and torch.device(device).type == "cuda":
            made.append(FakeCudaGenerator(device))
            return made[-1]
        return real_generator() if device is None else real_generator(device=device)

    states = iter(["global before", "stage after"])
    events = []
    monkeypatch.setattr(torch, "Generator", generator)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device: events.append(("get", str(device))) or next(states))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: events.append(("set", state, str(device))))
    randomness = StageRandomness(seed=7, replica=1, stage=2, device=torch.device("cuda", 1))
    (cuda,) = made
    assert cuda.device == torch.device("cuda", 1) and isinstance(cuda.seed, int)
    assert torch.equal(randomness._cpu, real_generator().manual_seed(cuda.seed).get_state())  # one seed, both streams
    with randomness.active():
        events.append("stage runs")
    assert events == [("get", "cuda:1"), ("set", f"stage seeded {cuda.seed}", "cuda:1"), "stage runs",
                      ("get", "cuda:1"), ("set", "global before", "cuda:1")]
    assert randomness._accelerator == "stage after"  # the stage's stream continues from there next time


# ----- the advice is for CPUs ----------------------------------------------------------------------------------
def test_the_advice_refuses_a_cuda_device_and_says_what_to_use_instead(monkeypatch):
    timed = []
    monkeypatch.setattr(advice_module.profile, "block_seconds", lambda *a, **k: timed.append(1))
    model = tiny_model()
    message = (r"predicts layouts for CPUs only, not for device 'cuda:0': it calibrates the speed-up of CPU threads "
               r"and the bandwidth of a host memory copy.*python benchmarks/run.py --device cuda")
    with pytest.raises(ValueError, match=message):
        calibrate(model, 4, 8, torch.device("cuda", 0))
    with pytest.raises(ValueError, match=message):
        advise(model, 2, 16, 10, torch.device("cuda", 0), Calibration(((1, 1.0),), 1e9))
    assert timed == []  # refused before timing anything


@pytest.mark.parametrize(("backend", "posted"), [("gloo", True), ("nccl", False)])
def test_the_terms_receive_is_posted_before_the_schedule_under_gloo_only(monkeypatch, backend, posted):
    receives = []
    monkeypatch.setattr(engine_module, "_shared", lambda group: True)
    monkeypatch.setattr(engine_module.dist, "get_backend", lambda group: backend)
    monkeypatch.setattr(engine_module.dist, "irecv", lambda tensor, **kwargs: receives.append(kwargs) or "work")
    first_stage = types.SimpleNamespace(_term_names={"train": ["loss", "ar"]}, has_last_stage=False,
                                        _terms_on_last_rank=True, groups=types.SimpleNamespace(pipeline="pipeline"),
                                        _last_stage_rank=1, device=torch.device("cpu"))
    early = PipelineEngine._receive_terms_early(first_stage, "train")
    assert (early is not None) == posted
    if posted:
        buffer, work = early
        assert buffer.shape == (2,) and buffer.dtype == torch.float64 and work == "work"
        assert receives == [{"group": "pipeline", "group_src": 1, "tag": engine_module._TERMS_TAG}]
    # The names are learned at the first batch of a mode; the last stage sends, never receives.
    assert PipelineEngine._receive_terms_early(first_stage, "eval") is None
    last_stage = types.SimpleNamespace(**{**vars(first_stage), "has_last_stage": True})
    assert PipelineEngine._receive_terms_early(last_stage, "train") is None

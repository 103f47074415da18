"""The GPU suite (#19): what the CPU guards cannot show, run on real CUDA GPUs with NCCL. ``pytest -m gpu -rs``.

Skipped without CUDA (CI has no GPU), and each multi-GPU test is skipped when fewer GPUs are visible than it needs.
One test (at least) per hazard of the GPU review:

1. ``bf16-mixed``: the LSTMs run in float32 (never float16 under autocast), the vocabulary layers in bfloat16, and
   the losses stay within :data:`BF16_TOLERANCE` of a float32 run; float16 precisions are refused before launch;
2. numerics: ``numerics="exact"`` (IEEE float32, deterministic cuDNN) repeats bitwise on one GPU, and every layout on
   NCCL (pp2, dp2, tp2 on 2 GPUs; dp2 x pp2 on 4) matches one GPU to :data:`EXACT_TOLERANCE`;
3. teardown: after ``fit``, ``validate`` and ``test`` the parameters and the optimizer state are still on the GPU;
4. object traffic: the default group is NCCL, the object groups gloo; the one-file checkpoint gather costs no GPU
   memory; one-file and sharded checkpoints written on NCCL hold the trained parameters;
5. timeline: every span on the device clock (every send after its forward) is ``tests/test_gpu_timeline.py``;
6. no CUDA generator reseeded while building or materializing a model; the stage cache stays bounded; the advice
   refuses a CUDA device.

The same hazards' CPU guards are ``tests/test_device_guards.py`` and ``tests/test_device_runs.py``.
"""

from __future__ import annotations

import linecache
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.distributed.tensor import DTensor

import lightning_mp_lstm  # noqa: F401  (registers "mp_lstm")
from lightning_mp_lstm import DivergenceGuard, MPLSTMStrategy
from lightning_mp_lstm.base import faults
from lightning_mp_lstm.checkpoint import consolidate, read_checkpoint
from lightning_mp_lstm.models.blocks import DecoderBlock
from lightning_mp_lstm.planning import calibration
from tests.helpers import FixedBatches, TrainLosses, assert_same_training, run_ranks, tiny_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

#: Relative difference allowed between a bf16-mixed and a float32 loss: the decoder's logits are bfloat16 (8 bits of
#: mantissa); the LSTMs are float32 in both runs.
BF16_TOLERANCE = 3e-2
#: Relative difference allowed between a layout on NCCL and one GPU, both with numerics="exact".
EXACT_TOLERANCE = 1e-5
STEPS = 4


def _needs(gpus: int) -> None:
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs, {torch.cuda.device_count()} visible")


def _strategy(**options: Any) -> MPLSTMStrategy:
    return MPLSTMStrategy(**{"report_after_steps": None, "timeout": 120, "n_microbatches": 2, **options})


def _trainer(strategy: Any, devices: int, callbacks: list[pl.Callback] | None = None, **kwargs: Any) -> pl.Trainer:
    return pl.Trainer(strategy=strategy, accelerator="cuda", devices=devices, callbacks=callbacks or [],
                      logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                      enable_checkpointing=False, **kwargs)


def _devices(module: torch.nn.Module, optimizer: torch.optim.Optimizer) -> set[str]:
    """The device types of ``module``'s parameters and of ``optimizer``'s state tensors."""
    found = {p.device.type for p in module.parameters()}
    for state in optimizer.state.values():
        found |= {v.device.type for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0}
    return found


# ----- 1 GPU: fit, validate, test, predict; teardown; generators; stage cache; advice ----------------------------
def _one_gpu(rank: int, world_size: int) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)  # the model's seed; torch.manual_seed reseeds the CUDA generators too, so it comes first
    torch.cuda.manual_seed_all(1234)
    before = torch.cuda.get_rng_state()
    strategy = _strategy(pipeline_parallel_size=1, partition="balanced", n_microbatches="auto")
    trainer = _trainer(strategy, 1, max_steps=STEPS, limit_val_batches=1)
    with trainer.init_module(empty_init=True):  # the strategy materializes the blocks on the GPU
        model = tiny_model(optimizer="adam", lr=0.01, seed=None)
    seen: dict[str, Any] = {"built": torch.equal(torch.cuda.get_rng_state(), before)}

    class Watch(pl.Callback):
        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            seen["materialized"] = torch.equal(torch.cuda.get_rng_state(), before)

        def on_predict_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any,
                                 *args: Any) -> None:
            # Lightning moves the predictions it returns to the CPU afterwards; the step's own output is checked here.
            seen.setdefault("predicted_on", []).append(outputs["log_probs"].device.type)

    trainer.callbacks.append(Watch())
    data = FixedBatches()
    trainer.fit(model, datamodule=data)
    optimizer = trainer.optimizers[0]
    seen["after_fit"] = _devices(model, optimizer)
    seen["val"] = trainer.validate(model, datamodule=data, verbose=False)[0]["val/loss"]
    seen["after_validate"] = _devices(model, optimizer)
    seen["test"] = trainer.test(model, datamodule=data, verbose=False)[0]
    seen["after_test"] = _devices(model, optimizer)
    predictions = trainer.predict(model, datamodule=data)
    seen["predicted"] = [tuple(p["log_probs"].shape) for p in predictions]
    engine = strategy.engine
    seen["cached"] = (len(engine.cached_shapes), engine.max_cached_shapes)
    seen["steps"] = trainer.global_step
    return seen


@pytest.mark.timeout(300)
def test_one_gpu_fits_validates_tests_and_predicts_and_keeps_everything_on_the_gpu():
    (seen,) = run_ranks(_one_gpu, 1, timeout=280)
    assert seen["steps"] == STEPS and torch.isfinite(torch.tensor(seen["val"]))
    assert seen["test"] and all(torch.isfinite(torch.tensor(v)) for v in seen["test"].values())
    # Teardown moves nothing to the CPU (item 3).
    assert seen["after_fit"] == seen["after_validate"] == seen["after_test"] == {"cuda"}
    assert seen["predicted"] and seen["predicted_on"] == ["cuda"] * len(seen["predicted"])
    # Building and materializing left the global CUDA generator alone (item 6).
    assert (seen["built"], seen["materialized"]) == (True, True)
    cached, bound = seen["cached"]
    assert 0 < cached <= bound


# ----- host synchronizations of a training step -----------------------------------------------------------------
#: The library's only reads of the device in a training step: the loss, for the finite check and DivergenceGuard.
LOSS_READS = {"if bool(torch.isfinite(loss).all()):", "return None if value is None else float(value)"}


def _synchronizations(rank: int, world_size: int) -> list[str]:
    warnings.filterwarnings("ignore")
    caught: list[Any] = []

    class Watch(pl.Callback):  # torch's sync debug mode warns at each synchronizing CUDA call, steps 3 to 6
        def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 3:
                self.context = warnings.catch_warnings(record=True)
                caught.extend([self.context.__enter__()])
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 7:
                torch.cuda.set_sync_debug_mode("default")
                self.context.__exit__(None, None, None)

    trainer = _trainer(_strategy(pipeline_parallel_size=1), 1, callbacks=[Watch()], max_steps=8,
                       limit_val_batches=0, gradient_clip_val=0.5)
    trainer.callbacks.append(DivergenceGuard(max_loss=100.0))
    trainer.fit(tiny_model(), datamodule=FixedBatches(train_lengths=(5,) * 8))
    (records,) = caught
    return [linecache.getline(w.filename, w.lineno).strip() for w in records
            if "synchroniz" in str(w.message) and "lightning_mp_lstm" in w.filename]


@pytest.mark.timeout(300)
def test_a_training_step_reads_the_device_only_for_its_loss():
    # A tensor made from a host number (new_tensor, as_tensor) was a copy that waited for the device every step.
    (lines,) = run_ranks(_synchronizations, 1, timeout=280)
    assert lines and set(lines) <= LOSS_READS, lines


def test_the_advice_refuses_a_cuda_device():
    with pytest.raises(ValueError, match="benchmarks/run.py --device cuda"):
        calibration.check_device(torch.device("cuda", 0))


# ----- precision: bf16-mixed against float32; float16 refused ----------------------------------------------------
def _precision_run(rank: int, world_size: int, precision: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    dtypes: dict[str, set[str]] = {}

    class Record(TrainLosses):
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            for stage in trainer.strategy.engine.stage_modules.values():
                for name, block in zip(stage.block_names, stage.blocks, strict=True):
                    # The decoder block hands its inputs on and the loss calls the decoder on slices of them: the
                    # logits' dtype is the decoder's own output.
                    block = block.decoder if isinstance(block, DecoderBlock) else block
                    block.register_forward_hook(
                        lambda module, args, out, name=name: dtypes.setdefault(name, set()).add(str(out.dtype)))

    record = Record()
    strategy = _strategy(pipeline_parallel_size=world_size, numerics="exact")
    trainer = _trainer(strategy, world_size, [record], max_steps=STEPS, precision=precision)
    trainer.fit(tiny_model(optimizer="adam", lr=0.01), datamodule=FixedBatches())
    return {"losses": [loss for _, loss in record.values], "dtypes": {k: sorted(v) for k, v in dtypes.items()}}


@pytest.mark.parametrize("gpus", [1, 2])
@pytest.mark.timeout(400)
def test_bf16_mixed_runs_the_lstms_in_float32_and_stays_within_tolerance_of_float32(gpus):
    _needs(gpus)
    per_rank = run_ranks(_precision_run, gpus, "bf16-mixed", timeout=190)
    reference = run_ranks(_precision_run, gpus, "32-true", timeout=190)[0]["losses"]
    seen: dict[str, list[str]] = {}
    for result in per_rank:
        seen.update(result["dtypes"])
    assert seen == {"embedding": ["torch.float32"], "lstm.0": ["torch.float32"], "lstm.1": ["torch.float32"],
                    "decoder": ["torch.bfloat16"]}, seen
    assert len(per_rank[0]["losses"]) == len(reference) == STEPS
    for got, expected in zip(per_rank[0]["losses"], reference, strict=True):
        assert got == pytest.approx(expected, rel=BF16_TOLERANCE)


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_float16_precisions_are_refused_before_launch_on_cuda(precision):
    strategy = _strategy(pipeline_parallel_size=1)
    _trainer(strategy, 1, max_steps=1, precision=precision)  # on CUDA, 16-mixed comes with a gradient scaler
    with pytest.raises(ValueError, match=r"\(float16\) is not supported: .* 'bf16-mixed' \(LSTMs in float32\)"):
        strategy.check(tiny_model())


# ----- numerics: exact mode repeats on one GPU; every layout on NCCL matches one GPU ------------------------------
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "pp2": (2, dict(pipeline_parallel_size=2)),
    "dp2": (2, dict(data_parallel_size=2, pipeline_parallel_size=1)),
    "tp2": (2, dict(tensor_parallel_size=2, pipeline_parallel_size=1)),
    "dp2xpp2": (4, dict(data_parallel_size=2, pipeline_parallel_size=2, schedule="GPipe")),
}


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor on the CPU (a tensor-parallel ``DTensor`` gathered)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


class FullGradients(pl.Callback):
    """Every parameter's whole gradient, on the CPU, before each optimizer step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any) -> None:
        self.steps.append({n: _full(p.grad) for n, p in pl_module.named_parameters() if p.grad is not None})


def _exact_run(rank: int, world_size: int, layout: str | None) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    options = LAYOUTS[layout][1] if layout else dict(pipeline_parallel_size=1)
    losses, grads = TrainLosses(), FullGradients()
    trainer = _trainer(_strategy(numerics="exact", **options), world_size, [losses, grads], max_steps=STEPS)
    model = tiny_model(vocab=38, optimizer="adam", lr=0.01)  # 38: the tensor-parallel split needs an even vocabulary
    data = FixedBatches()
    trainer.fit(model, datamodule=data)
    predictions = trainer.predict(model, datamodule=data)
    flags = [torch.backends.cudnn.rnn.fp32_precision, torch.backends.cudnn.deterministic]
    backends = None
    if dist.is_initialized():
        group = faults.object_group()
        backends = [dist.get_backend(), dist.get_backend(group) if group is not None else None]
    return {"losses": losses.values, "grads": grads.steps,
            "params": {n: _full(p) for n, p in model.named_parameters()},
            "predictions": [{k: v.cpu() for k, v in p.items()} for p in predictions], "flags": flags,
            "backends": backends}


@pytest.fixture(scope="module")
def one_gpu_exact() -> dict[str, Any]:
    return run_ranks(_exact_run, 1, None, timeout=200)[0]


@pytest.mark.timeout(300)
def test_exact_numerics_repeats_bitwise_on_one_gpu(one_gpu_exact):
    again = run_ranks(_exact_run, 1, None, timeout=200)[0]
    assert one_gpu_exact["flags"] == ["ieee", True]
    assert again["losses"] == one_gpu_exact["losses"]
    for name, value in one_gpu_exact["params"].items():
        assert torch.equal(again["params"][name], value), name


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.timeout(400)
def test_every_layout_on_nccl_matches_one_gpu_with_exact_numerics(one_gpu_exact, layout):
    world = LAYOUTS[layout][0]
    _needs(world)
    per_rank = run_ranks(_exact_run, world, layout, timeout=380)
    for result in per_rank:
        assert result["flags"] == ["ieee", True]
        assert result["backends"] == ["nccl", "gloo"]  # training on NCCL, objects on a gloo group (item 4)
    assert_same_training(per_rank, one_gpu_exact, STEPS, tol=EXACT_TOLERANCE)
    for result in per_rank:
        for got, expected in zip(result["predictions"], one_gpu_exact["predictions"], strict=True):
            torch.testing.assert_close(got["log_probs"], expected["log_probs"], rtol=EXACT_TOLERANCE, atol=1e-6)


# ----- checkpoints on NCCL: one file (gathered over gloo, no GPU memory) and sharded ------------------------------
def _save(rank: int, world_size: int, directory: str, checkpoint_format: str) -> dict[str, Any]:
    warnings.filterwarnings("ignore")
    strategy = _strategy(pipeline_parallel_size=2, numerics="exact", checkpoint_format=checkpoint_format)
    trainer = _trainer(strategy, world_size, max_steps=STEPS)
    # Big enough that one rank's pickled state (parameters and Adam's moments, a few MiB) would show in the GPU's peak
    # memory if the gather went through NCCL.
    model = tiny_model(embedding_dim=64, hidden_size=256, optimizer="adam", lr=0.01)
    trainer.fit(model, datamodule=FixedBatches())
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in model.parameters())  # parameters + two moments
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer.save_checkpoint(Path(directory) / f"{checkpoint_format}.ckpt")
    torch.cuda.synchronize()
    return {"params": {n: p.detach().cpu() for n, p in model.named_parameters()}, "state_bytes": state_bytes,
            "extra_gpu_bytes": torch.cuda.max_memory_allocated() - allocated}


@pytest.mark.parametrize("checkpoint_format", ["file", "sharded"])
@pytest.mark.timeout(300)
def test_checkpoints_written_on_nccl_hold_the_trained_parameters(checkpoint_format, tmp_path):
    _needs(2)
    per_rank = run_ranks(_save, 2, str(tmp_path), checkpoint_format, timeout=280)
    path = tmp_path / f"{checkpoint_format}.ckpt"
    if checkpoint_format == "sharded":
        consolidate(path, tmp_path / "consolidated.ckpt")
        path = tmp_path / "consolidated.ckpt"
    else:
        for rank, result in enumerate(per_rank):  # the gather pickled the states in host memory, not on the GPU
            assert result["extra_gpu_bytes"] < result["state_bytes"] / 2, (rank, result)
    saved = read_checkpoint(path)["state_dict"]
    held = {}
    for result in per_rank:
        held.update(result["params"])
    assert held and set(held) <= set(saved)
    for name, value in held.items():
        assert torch.equal(saved[name], value), name

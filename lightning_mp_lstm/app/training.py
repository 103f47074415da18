"""The Hydra application behind ``train.py``, shaped like lightning-hydra-template: the config decides, ``train``
instantiates the data module, strategy, model, callbacks, logger and trainer from it, checks, then fits.

``train(cfg)`` is a plain function so tests and notebooks can call it with a composed config.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import hydra
import lightning.pytorch as pl
import torch
from hydra.errors import InstantiationException
from lightning.pytorch.callbacks import Callback, ModelCheckpoint, ProgressBar
from lightning.pytorch.loggers import Logger
from omegaconf import DictConfig

from lightning_mp_lstm.app import console
from lightning_mp_lstm.app.autopilot import apply_choice, autopilot_declined, choose_layout, cpu_cores, inherited_choice
from lightning_mp_lstm.app.option_types import check_option_types, check_option_values
from lightning_mp_lstm.app.run_name import register_resolver
from lightning_mp_lstm.app.stopped import continue_logs, exit_when_stopped, resume_command
from lightning_mp_lstm.checkpoint import is_sharded, local_model_state, read_checkpoint, read_sharded
from lightning_mp_lstm.data.vocab import Vocabulary, vocabulary_difference
from lightning_mp_lstm.models.lstm_language_model import LSTMLanguageModel, perplexity
from lightning_mp_lstm.planning.layout import LayoutError
from lightning_mp_lstm.strategy.launcher import CHECKED_BY
from lightning_mp_lstm.timeline import PipelineTimeline

__all__ = ["BestCheckpoint", "best_checkpoint", "build_model", "build_strategy", "build_trainer", "check_resume",
           "exit_when_stopped", "format_summary", "instantiate_callbacks", "instantiate_loggers", "metric_value",
           "resume_command", "train", "trainer_devices"]

register_resolver()  # ${mp_lstm.run_name:} in conf/train.yaml's run directory


def _build(node: DictConfig, group: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` whose error is the target's own, prefixed with the config group, instead of
    Hydra's two-line wrapper; a word given where a number is taken is refused first, by the option's name."""
    check_option_types(node, group)
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as error:
        cause = error.__cause__
        if cause is None:
            raise
        try:
            clearer = type(cause)(f"{group}: {cause}")
        except Exception:  # noqa: BLE001  (an exception class that takes other arguments: keep Hydra's)
            raise error from None
        raise clearer from error


def check_resume(path: str, model: pl.LightningModule, datamodule: pl.LightningDataModule) -> dict[str, Any]:
    """Check that the checkpoint at ``path`` (a file or a sharded directory) can resume ``model`` on ``datamodule``:
    readable, undamaged (every tensor, or every block, against the checksums recorded when it was written), every
    tensor of the model's shape, and (for :class:`LMDataModule`) the vocabulary the data was built with. It reads
    only the names and shapes of ``model.state_dict()``, so a model still on the meta device will do.

    Returns:
        The checkpoint (a sharded directory's: its model entries as meta tensors of the stored shapes).

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: a damaged file, or tensors of another model size.
        ValueError: the checkpoint's vocabulary differs from the data's.
    """
    saved = read_sharded(path) if is_sharded(path) else read_checkpoint(path)
    state = saved.get(type(datamodule).__qualname__) or {}
    vocab = getattr(datamodule, "vocab", None)
    if "vocab" in state and isinstance(vocab, Vocabulary):  # first: another vocabulary also changes the shapes
        difference = vocabulary_difference(Vocabulary.from_state_dict(state["vocab"]), vocab)
        if difference is not None:
            raise ValueError(
                f"the checkpoint's vocabulary differs from the one built from the training data (checkpoint vs "
                f"data: {difference}): the model learned other words for these ids. Resume with the data the "
                "checkpoint was trained on, or start a new run"
            )
    own = model.state_dict()
    local_model_state(model, saved["state_dict"], strict=model.strict_loading, full_keys=own.keys())
    return saved


def _instantiate_group(node: DictConfig | None, group: str) -> list[Any]:
    """Every entry of a group of named objects (``callbacks``, ``logger``) that has a ``_target_``, in order."""
    if not node:
        return []
    return [_build(entry, f"{group}.{name}") for name, entry in node.items()
            if isinstance(entry, DictConfig) and "_target_" in entry]


def instantiate_callbacks(callbacks: DictConfig | None, trainer: DictConfig | None = None) -> list[Callback]:
    """The callbacks of the ``callbacks`` group (one entry per callback, each with a ``_target_``).

    A progress bar is left out when ``trainer.enable_progress_bar`` is false (``trainer=ci``): Lightning refuses
    a progress bar callback then, and the setting means no progress bar.
    """
    built = _instantiate_group(callbacks, "callbacks")
    if trainer is not None and trainer.get("enable_progress_bar") is False:
        built = [c for c in built if not isinstance(c, ProgressBar)]
    return built


def instantiate_loggers(logger: DictConfig | None) -> list[Logger]:
    """The loggers of the ``logger`` group (one entry per logger, each with a ``_target_``)."""
    return _instantiate_group(logger, "logger")


def build_strategy(cfg: DictConfig) -> Any:
    """The strategy of ``cfg.strategy``; it checks its options here (an error names the ``strategy`` group)."""
    return _build(cfg.strategy, "strategy")


def build_model(cfg: DictConfig, strategy: Any, vocab_size: int) -> pl.LightningModule:
    """The model of ``cfg.model``, built inside ``strategy.tensor_init_context(empty_init=True)``: on the meta
    device, so that no process allocates blocks it will not hold (the strategy materializes its own in
    ``setup``)."""
    stream = cfg.data.get("mode") == "stream"  # a continuous token stream: carry each row's state across batches
    with strategy.tensor_init_context(empty_init=True):
        return _build(cfg.model, "model", vocab_size=vocab_size, **({"carry_state": True} if stream else {}))


def trainer_devices(cfg: DictConfig, strategy: Any, model: Any) -> Any:
    """``devices`` for the Trainer: ``trainer.devices`` when set (the strategy checks it when the Trainer is built),
    else what ``strategy.processes_for(model)`` needs, per node (divided by ``trainer.num_nodes``), else
    ``layout.processes`` (``layout=auto`` that ran one pipeline without ranking layouts: the CPU cores), else 1.

    Raises:
        LayoutError: the processes the strategy needs do not spread evenly over the nodes.
    """
    devices = cfg.trainer.get("devices")
    if devices is not None:
        return devices
    needed = strategy.processes_for(model)
    if needed is None:
        processes = cfg.get("layout", {}).get("processes") or 1
        return cpu_cores() if processes == "auto" else int(processes)
    num_nodes = int(cfg.trainer.get("num_nodes") or 1)
    if needed % num_nodes:
        raise LayoutError(f"the layout needs {needed} processes, which cannot be spread evenly over "
                          f"trainer.num_nodes={num_nodes} nodes")
    return needed // num_nodes


def build_trainer(cfg: DictConfig, strategy: Any, model: Any) -> pl.Trainer:
    """The Trainer of ``cfg.trainer``, with ``strategy``, the callbacks and loggers of the config, and
    :func:`trainer_devices` processes per node. Building it resolves the strategy's layout (and checks a
    ``trainer.devices`` that disagrees with it); nothing is launched."""
    return _build(
        cfg.trainer, "trainer", devices=trainer_devices(cfg, strategy, model), strategy=strategy,
        callbacks=instantiate_callbacks(cfg.get("callbacks"), cfg.trainer),
        logger=instantiate_loggers(cfg.get("logger")) or False,
    )


class BestCheckpoint(NamedTuple):
    """The checkpoint a :class:`~lightning.pytorch.callbacks.ModelCheckpoint` found best: where, and its score."""

    path: str
    monitor: str
    score: float


def best_checkpoint(trainer: pl.Trainer) -> BestCheckpoint | None:
    """The best checkpoint of the Trainer's (first) ``ModelCheckpoint``, when it monitors a metric and wrote a
    checkpoint with a score; else ``None`` (no checkpoint callback, Lightning's default one that monitors nothing,
    or none written yet: a resumed run whose callback kept only the path of an earlier run's best)."""
    callback = trainer.checkpoint_callback
    if not isinstance(callback, ModelCheckpoint) or not callback.monitor or not callback.best_model_path:
        return None
    if callback.best_model_score is None:
        return None
    return BestCheckpoint(callback.best_model_path, callback.monitor, float(callback.best_model_score))


class _TrainingClock(Callback):
    """Seconds from the start of training to its end on this process: the steps and the validations between them,
    not starting the processes, planning or the final evaluation."""

    def __init__(self) -> None:
        self.started: float | None = None
        self.seconds: float | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.started = time.perf_counter()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.started is not None:
            self.seconds = time.perf_counter() - self.started


class _LoadedStep(Callback):
    """The global step of the checkpoint a ``validate``/``test`` loaded (for the summary's "evaluated weights")."""

    def __init__(self) -> None:
        self.global_step: int | None = None

    def on_load_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict) -> None:
        self.global_step = checkpoint.get("global_step")


def metric_value(summary: dict[str, Any], name: str | None) -> float | None:
    """The value of the metric ``name`` in a :func:`train` summary: what ``train.py`` returns to a Hydra sweeper
    (``optimized_metric``, which only a sweep's config sets: ``hparams_search=lstm_optuna`` asks for ``val/loss``).
    ``None`` when ``name`` is empty (a plain run).

    Raises:
        KeyError: the run logged no metric of that name (the message lists those it logged).
    """
    if not name:
        return None
    metrics = summary.get("metrics", {})
    if name not in metrics:
        raise KeyError(f"optimized_metric={name!r} was not logged by this run; it logged: "
                       f"{', '.join(sorted(metrics)) or 'nothing'}. A sweep needs every trial to log it (val/... "
                       "metrics need a validation: evaluate=true, or a validation before the run ends)")
    return metrics[name]


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The single-number metrics of ``metrics`` (tensors or numbers), as floats."""
    return {name: float(value) for name, value in metrics.items()
            if not isinstance(value, torch.Tensor) or value.numel() == 1}


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train (and evaluate) the configured model; return the summary numbers.

    Checks first the options nothing else checks before they are used (:func:`check_option_values`); instantiates
    the strategy, the data module (set up for fitting: the vocabulary sizes the model), the model (on the meta
    device, inside the strategy's init context), the callbacks, the loggers and the Trainer (which resolves the
    layout; nothing is launched yet); then checks, before any process starts, the data's batches for the layout's
    replicas, that the strategy can run the model on them, and that ``ckpt_path`` fits and is undamaged
    (:func:`check_resume`; a run resumed into its folder continues its ``metrics.csv``:
    :func:`~lightning_mp_lstm.app.stopped.continue_logs`); then fits, validates and tests the best checkpoint
    (:func:`best_checkpoint`; the last weights when there is none), prints the summary table on global rank 0, and
    ends the job's processes (``strategy.shutdown()``) whatever happened. A rank process the launching process
    started skips the checks that process made before starting it.

    Args:
        cfg: a config composed from ``conf/train.yaml``.

    Returns:
        dict with validation/test loss and perplexity and which weights they are from (``evaluated``), the
        synthetic floor and unigram baseline (when known), training tokens per second, ``train_seconds`` (from the
        start of training to its end on global rank 0: steps and validations, not starting the processes) and
        ``total_seconds`` (this call, start to end), the checkpoint and log directories, and ``metrics``: every
        scalar metric by name (``val/loss``, ``test/loss``, ...; after evaluating, those of the evaluated weights),
        from which :func:`metric_value` reads ``optimized_metric``.
    """
    started = time.perf_counter()
    console.quiet()  # each message once, from rank 0; no warning the user cannot act on
    check_option_values(cfg)  # before anything is built: an option out of its range, by name
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    strategy = build_strategy(cfg)
    # A rank started by this job's launching process skips what that process checked before starting it; the checks
    # that every rank needs run again when the strategy sets up and loads the checkpoint.
    checked = os.environ.get(CHECKED_BY) is not None
    try:
        datamodule = _build(cfg.data, "data")
        datamodule.prepare_data()
        datamodule.setup("fit")
        model = build_model(cfg, strategy, datamodule.vocab_size)
        strategy = _autopilot(cfg, strategy, model, datamodule, checked)
        trainer = build_trainer(cfg, strategy, model)
        # Fail here, before any process starts, on what the ranks would otherwise each find after launching: the
        # data module's batch samplers for the strategy's replicas (batch size, token budget, sentences per
        # replica; attached to the Trainer as fit() attaches it, its setup builds and checks them), whether the
        # strategy can run the model on these batches, and whether the checkpoint fits and is undamaged.
        datamodule.trainer = trainer
        if not checked:
            datamodule.setup("fit")
            strategy.check(model, datamodule)
            if cfg.ckpt_path:
                saved = check_resume(cfg.ckpt_path, model, datamodule)
                continue_logs(trainer, int(saved.get("global_step") or 0))
        _set_example_input(model, datamodule)  # sized by the checked batch options
        clock = _TrainingClock()
        trainer.callbacks.append(clock)
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        trainer.callbacks.remove(clock)
        # Before evaluating: loading a checkpoint restores the checkpoint callback's state as it was saved.
        best = best_checkpoint(trainer)
        checkpoint = trainer.checkpoint_callback
        saved = best.path if best else None
        if saved is None and checkpoint is not None:  # the last one written (a monitor-less callback's "best")
            saved = checkpoint.last_model_path or checkpoint.best_model_path
        log_dir = trainer.logger.log_dir if trainer.logger is not None else None
        summary: dict[str, Any] = {
            "train_seconds": clock.seconds,
            "tokens_per_s": float(trainer.callback_metrics.get("train/tokens_per_s_epoch", float("nan"))),
            "checkpoint": saved or None,
            "logs": log_dir,
            "entropy_floor_ppl": getattr(datamodule, "entropy_floor", None),
            # Global rank 0 prints the table: the others need not read the training split for it.
            "unigram_ppl": getattr(datamodule, "unigram_perplexity", None) if trainer.is_global_zero else None,
            "timeline": _timeline_paths(trainer),
            "evaluated": None,
            "metrics": _scalars(trainer.callback_metrics),  # the last validation's, unless evaluated below
        }
        if cfg.evaluate:
            loaded = _LoadedStep()
            trainer.callbacks.append(loaded)
            for split, run in (("val", trainer.validate), ("test", trainer.test)):
                # The best checkpoint, as lightning-hydra-template tests it (ckpt_path=best_model_path); the
                # strategy loads it into whatever layout this run has.
                results = run(model, datamodule=datamodule, ckpt_path=best.path if best else None, verbose=False)
                summary["metrics"].update(_scalars(results[0]))
                loss = float(results[0][f"{split}/loss"])
                summary[f"{split}_loss"] = loss
                summary[f"{split}_ppl"] = perplexity(loss)
            trainer.callbacks.remove(loaded)
            summary["evaluated"] = _weights(best, loaded.global_step)
    finally:
        strategy.shutdown()  # end this job's processes: the next job of a multirun starts its own
    summary["total_seconds"] = time.perf_counter() - started
    if trainer.is_global_zero:
        print(format_summary(summary))
    return summary


def _autopilot(cfg: DictConfig, strategy: Any, model: pl.LightningModule, datamodule: Any, checked: bool) -> Any:
    """The strategy of the layout ``layout=auto`` chooses (:mod:`~lightning_mp_lstm.app.autopilot`): chosen here by
    the launching process, taken from it by the rank processes it starts; ``strategy`` itself where the command
    fixes the layout."""
    declined = autopilot_declined(cfg, strategy, model)
    if declined is not None:
        if not checked and cfg.get("layout", {}).get("pipeline_parallel_size") == "auto":
            print(f"mp_lstm: layout=auto runs one pipeline without ranking layouts: {declined}")
        return strategy
    settings = inherited_choice() if checked else choose_layout(cfg, strategy, model, datamodule)
    if settings is None:
        return strategy
    apply_choice(cfg, settings)
    return build_strategy(cfg)


def _set_example_input(model: pl.LightningModule, datamodule: Any) -> None:
    """One global batch of the data's mean padded length as the model's ``example_input_array``, so that Lightning's
    model summary counts the forward's FLOPs (and shows every layer's in and out sizes). Only for the library's
    model, whose forward takes a ``(batch, length)`` tensor of token ids; a model that has one keeps it."""
    rows, length = getattr(datamodule, "batch_size", None), getattr(datamodule, "mean_padded_length", None)
    if isinstance(model, LSTMLanguageModel) and model.example_input_array is None and rows and length:
        model.example_input_array = torch.zeros((int(rows), max(1, round(length))), dtype=torch.long)


def _weights(best: BestCheckpoint | None, step: int | None) -> str:
    """Which weights the evaluation ran on, for the summary table."""
    if best is None:
        return "last (no best checkpoint)"
    at = f", step {step}" if step is not None else ""
    return f"{Path(best.path).name} ({best.monitor} {best.score:.4f}{at})"


def _timeline_paths(trainer: pl.Trainer) -> str | None:
    """The picture and the Chrome trace the timeline callback wrote, if it recorded a step."""
    for callback in trainer.callbacks:
        if isinstance(callback, PipelineTimeline) and callback.paths:
            return ", ".join(str(callback.paths[k]) for k in ("png", "trace"))
    return None


def format_summary(summary: dict[str, Any]) -> str:
    """The closing table of a run."""
    def fmt(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:,.2f}" if isinstance(value, float) else str(value)

    evaluated = summary.get("evaluated")
    rows = [
        *([("validation perplexity", summary.get("val_ppl")), ("test perplexity", summary.get("test_ppl")),
           ("evaluated weights", evaluated)] if evaluated else [("evaluated weights", "none (evaluate=false)")]),
        # The floor exists for the synthetic language only (its true model is known).
        *([("synthetic floor (true model)", summary["entropy_floor_ppl"])] if summary.get("entropy_floor_ppl") else []),
        ("unigram baseline", summary.get("unigram_ppl")),
        ("train tokens / s", summary.get("tokens_per_s")),
        ("training time (s)", summary.get("train_seconds")),
        ("total time (s)", summary.get("total_seconds")),
        ("checkpoint", summary.get("checkpoint")),
        ("logs", summary.get("logs")),
        ("timeline (picture, trace)", summary.get("timeline")),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 40)
    return "\n".join([line, *(f"{k:<{width}}  {fmt(v)}" for k, v in rows), line])

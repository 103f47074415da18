"""The Hydra application behind ``train.py``: compose data, model, layout and trainer, then fit.

``train(cfg)`` is a plain function so tests and notebooks can call it with a composed config.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
from hydra.errors import InstantiationException
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from omegaconf import DictConfig, OmegaConf

from lightning_mp_lstm.checkpoint import local_model_state, read_checkpoint
from lightning_mp_lstm.data.vocab import Vocabulary, vocabulary_difference
from lightning_mp_lstm.layout import LayoutError
from lightning_mp_lstm.model import perplexity
from lightning_mp_lstm.strategy import MPLSTMStrategy

__all__ = ["ResolvedLayout", "check_resume", "resolve_layout", "train"]


@dataclass(frozen=True)
class ResolvedLayout:
    """Process layout decided from the ``layout``, ``partition``, ``schedule`` and ``trainer`` groups."""

    data_parallel_size: int
    pipeline_parallel_size: int
    stages_per_rank: int

    @property
    def devices(self) -> int:
        return self.data_parallel_size * self.pipeline_parallel_size


def _partition_stage_count(cfg: DictConfig) -> int | None:
    stages = cfg.partition.stages
    if cfg.partition.get("num_stages"):
        return int(cfg.partition.num_stages)
    if stages == "per_layer":
        return int(cfg.model.num_layers) + 2
    if OmegaConf.is_list(stages):
        return len(stages)
    return None


def resolve_layout(cfg: DictConfig) -> ResolvedLayout:
    """Decide data-parallel size, pipeline size and stages per process from a composed config.

    The layout group wins where it is explicit; otherwise the pipeline size follows the partition's
    stage count, else ``trainer.devices`` (data parallelism fills what the pipeline leaves). Conflicts
    are errors that name every value involved.

    Raises:
        LayoutError: the groups ask for different numbers of stages or processes.
    """
    layout, trainer = cfg.layout, cfg.trainer
    spr = int(layout.stages_per_rank or cfg.schedule.get("stages_per_rank") or 1)
    stages = _partition_stage_count(cfg)
    devices = trainer.get("devices")
    devices = int(devices) if isinstance(devices, int) or (isinstance(devices, str) and devices.isdigit()) else None
    num_nodes = int(trainer.get("num_nodes") or 1)
    if devices is not None:
        devices *= num_nodes  # trainer.devices counts processes per node
    dp = layout.data_parallel_size
    pp = layout.pipeline_parallel_size
    if pp is None:
        if stages is not None:
            if stages % spr:
                raise LayoutError(
                    f"partition has {stages} stages, which is not a multiple of stages_per_rank={spr}"
                )
            pp = stages // spr
        elif devices is not None:
            pp = devices // int(dp or 1)
        else:
            pp = 1
    pp = int(pp)
    if dp is None:
        dp = devices // pp if devices is not None and devices % pp == 0 else 1
    dp = int(dp)
    if stages is not None and stages != pp * spr:
        raise LayoutError(
            f"partition {cfg.partition.get('stages')!r} has {stages} stages but the layout gives "
            f"pipeline_parallel_size={pp} x stages_per_rank={spr} = {pp * spr}; pick a matching layout or partition"
        )
    if devices is not None and devices != dp * pp:
        raise LayoutError(
            f"trainer.devices x trainer.num_nodes = {devices} processes but the layout needs "
            f"data_parallel_size={dp} x pipeline_parallel_size={pp} = {dp * pp} processes"
        )
    if (dp * pp) % num_nodes:
        raise LayoutError(f"{dp * pp} processes cannot be spread evenly over trainer.num_nodes={num_nodes}")
    return ResolvedLayout(dp, pp, spr)


def _partition_option(cfg: DictConfig) -> Any:
    stages = cfg.partition.stages
    if stages == "per_layer":
        return "per_block"
    if OmegaConf.is_list(stages):
        return OmegaConf.to_container(stages)  # as given: the strategy names what is wrong with it
    return stages


def _strategy(cfg: DictConfig, resolved: ResolvedLayout) -> Any:
    if resolved.devices == 1 and cfg.partition.stages in ("even", None):
        return "auto"
    # The strategy validates the layout and schedule here, before any process starts.
    return MPLSTMStrategy(
        pipeline_parallel_size=resolved.pipeline_parallel_size,
        data_parallel_size=resolved.data_parallel_size,
        stages_per_rank=resolved.stages_per_rank,
        partition=_partition_option(cfg),
        balance_by=cfg.partition.balance_by or "time",
        schedule=cfg.schedule.name,
        n_microbatches=cfg.schedule.n_microbatches,
    )


def _build(node: DictConfig, group: str, **kwargs: Any) -> Any:
    """``hydra.utils.instantiate`` whose error is the target's own, prefixed with the config group, instead of
    Hydra's two-line wrapper."""
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


def check_resume(path: str, model: pl.LightningModule, datamodule: pl.LightningDataModule) -> None:
    """Check that the checkpoint at ``path`` can resume ``model`` on ``datamodule``: readable, every tensor of
    the model's shape, and (for :class:`LMDataModule`) the vocabulary the data was built with.

    Raises:
        FileNotFoundError: no such file.
        CheckpointError: a damaged file, or tensors of another model size.
        ValueError: the checkpoint's vocabulary differs from the data's.
    """
    saved = read_checkpoint(path)
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


def train(cfg: DictConfig) -> dict[str, Any]:
    """Train (and evaluate) the configured model; return the summary numbers.

    Args:
        cfg: a config composed from ``conf/train.yaml``.

    Returns:
        dict with validation/test loss and perplexity, the synthetic floor and unigram baseline (when
        known), training tokens per second, the checkpoint and log directories.
    """
    # Every rank holds the same global loss and metrics, so Lightning's advice to all-reduce them is moot.
    warnings.filterwarnings("ignore", message=r".*sync_dist=True.*")
    pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
    resolved = resolve_layout(cfg)
    strategy = _strategy(cfg, resolved)
    datamodule = _build(cfg.data, "data")
    datamodule.prepare_data()
    datamodule.setup("fit")
    model = _build(cfg.model, "model", vocab_size=datamodule.vocab_size)
    # Fail here, before any process starts, on what the ranks would otherwise each find after launching.
    if isinstance(strategy, MPLSTMStrategy):
        strategy.check(model, datamodule)
    if cfg.ckpt_path:
        check_resume(cfg.ckpt_path, model, datamodule)
    run_dir = Path(cfg.checkpoint_dir).parent
    checkpoint = ModelCheckpoint(dirpath=cfg.checkpoint_dir, monitor="val/loss", save_last=True, filename="best")
    trainer: pl.Trainer = hydra.utils.instantiate(
        cfg.trainer,
        devices=resolved.devices // int(cfg.trainer.get("num_nodes") or 1),
        strategy=strategy,
        callbacks=[checkpoint],
        logger=CSVLogger(str(run_dir), name="logs", version=""),
    )
    try:
        started = time.perf_counter()
        trainer.fit(model, datamodule=datamodule, ckpt_path=cfg.ckpt_path)
        fit_seconds = time.perf_counter() - started
        summary: dict[str, Any] = {
            "fit_seconds": fit_seconds,
            "tokens_per_s": float(trainer.callback_metrics.get("train/tokens_per_s_epoch", float("nan"))),
            "checkpoint": checkpoint.best_model_path or checkpoint.last_model_path,
            "logs": str(Path(trainer.logger.log_dir)) if trainer.logger else None,
            "entropy_floor_ppl": getattr(datamodule, "entropy_floor", None),
            "unigram_ppl": getattr(datamodule, "unigram_perplexity", None),
        }
        if cfg.evaluate:
            for split, run in (("val", trainer.validate), ("test", trainer.test)):
                results = run(model, datamodule=datamodule, verbose=False)
                loss = float(results[0][f"{split}/loss"])
                summary[f"{split}_loss"] = loss
                summary[f"{split}_ppl"] = perplexity(loss)
    finally:
        if isinstance(strategy, MPLSTMStrategy):
            strategy.shutdown()  # end this job's processes: the next job of a multirun starts its own
    if trainer.is_global_zero:
        print(format_summary(summary))
    return summary


def format_summary(summary: dict[str, Any]) -> str:
    """The closing table of a run."""
    def fmt(value: Any) -> str:
        if value is None:
            return "-"
        return f"{value:,.2f}" if isinstance(value, float) else str(value)

    rows = [
        ("validation perplexity", summary.get("val_ppl")),
        ("test perplexity", summary.get("test_ppl")),
        ("synthetic floor (true model)", summary.get("entropy_floor_ppl")),
        ("unigram baseline", summary.get("unigram_ppl")),
        ("train tokens / s", summary.get("tokens_per_s")),
        ("fit time (s)", summary.get("fit_seconds")),
        ("checkpoint", summary.get("checkpoint")),
        ("logs", summary.get("logs")),
    ]
    width = max(len(k) for k, _ in rows)
    line = "-" * (width + 40)
    return "\n".join([line, *(f"{k:<{width}}  {fmt(v)}" for k, v in rows), line])

"""``layout=auto``: the fastest layout that fits, chosen before launch and run.

The launching process ranks every layout of the machine's processes (one process, data parallel, pipelines and
wavefront pipelines, and their products; where replicas cannot hold their stages, the same layouts with replicas that
shard them; :mod:`~lightning_mp_lstm.planning.autopilot`), prints the table and sets the layout and schedule groups
(and ``strategy.shard_replicas``) to the fastest that fits. The rank processes it starts take its choice from the
environment (:data:`CHOICE`) instead of timing again, so every process runs the same layout.

The autopilot leaves the layout to the command, as ``layout=auto`` did before it, where the command already fixes
part of it: a partition with a stage count, a data- or tensor-parallel size, a schedule other than GPipe or 1F1B,
a microbatch count, ``strategy.shard_replicas``, several nodes, or processes started by ``torchrun``/``srun``. It
times blocks and threads on the CPU only; on a GPU it says so and runs one pipeline over the devices.

A script that builds its own ``Trainer`` calls :func:`auto_strategy` before it: the strategy and the number of
devices of the pick (a strategy cannot change the Trainer's devices once the Trainer holds them).
"""

from __future__ import annotations

import inspect
import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from omegaconf import DictConfig, open_dict

from lightning_mp_lstm.app.step_cost import COLLECTIVES, step_costs
from lightning_mp_lstm.models.binding import pipeline_model
from lightning_mp_lstm.models.optimizer_kernels import kernel_options
from lightning_mp_lstm.planning.autopilot import (
    TIE,
    RankedLayout,
    choose,
    fastest_that_fits,
    rank_layouts,
    render_ranking,
)
from lightning_mp_lstm.planning.calibration import calibrate
from lightning_mp_lstm.planning.layout import WAVEFRONT, ParallelLayout, schedule_style
from lightning_mp_lstm.planning.memory import process_floor
from lightning_mp_lstm.strategy.launcher import CHECKED_BY
from lightning_mp_lstm.strategy.memory_check import largest_batch, model_memory

__all__ = ["CHOICE", "apply_choice", "auto_strategy", "autopilot_declined", "candidate_threads", "choose_layout",
           "cpu_cores", "inherited_choice", "layout_overrides", "optimizer_maker", "rank_layouts_for", "rank_run"]

#: The strategy options the autopilot chooses (:func:`auto_strategy` refuses them).
CHOSEN_OPTIONS = ("data_parallel_size", "pipeline_parallel_size", "tensor_parallel_size", "schedule", "n_microbatches",
                  "time_chunks", "shard_replicas")

#: The environment variable that hands the launching process's choice (JSON: the layout and schedule settings) to
#: the rank processes it starts.
CHOICE = "MP_LSTM_LAYOUT_CHOICE"


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity where the system says it, else the CPU count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def autopilot_declined(cfg: DictConfig, strategy: Any, model: Any) -> str | None:
    """Why ``layout=auto`` keeps the command's own layout (``None``: the autopilot chooses)."""
    layout, schedule = cfg.get("layout") or {}, cfg.get("schedule") or {}
    if layout.get("pipeline_parallel_size") != "auto":
        return "the layout is not auto"
    if int(layout.get("data_parallel_size") or 1) != 1 or int(layout.get("tensor_parallel_size") or 1) != 1:
        return "layout.data_parallel_size or layout.tensor_parallel_size is set"
    if strategy.processes_for(model) is not None:
        return "the partition has a stage count"
    if schedule_style(str(schedule.get("name", "1F1B")))[1] != "single":
        return f"schedule {schedule.get('name')} is not GPipe or 1F1B"
    if schedule.get("n_microbatches") not in (None, "auto"):
        return "schedule.n_microbatches is set"
    if (cfg.get("strategy") or {}).get("shard_replicas"):
        return "strategy.shard_replicas is set"
    if int(cfg.trainer.get("num_nodes") or 1) != 1:
        return "the job spans several nodes"
    if "WORLD_SIZE" in os.environ and CHECKED_BY not in os.environ:
        return "its processes were started by torchrun or a scheduler"
    return None


def _planning_device(cfg: DictConfig) -> torch.device:
    accelerator = str(cfg.trainer.get("accelerator") or "auto")
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return torch.device("cuda")
    return torch.device("cpu") if accelerator in ("cpu", "auto") else torch.device(accelerator)


def candidate_threads(cores: int, counts: list[int]) -> list[int]:
    """The thread counts the candidates' processes run on (``cores`` shared by each count of processes), each of which
    the calibration must measure: a count it did not measure is taken at the speed of the largest one below it (on 16
    cores, 4 processes of 4 threads each were predicted at one thread's speed)."""
    return sorted({cores, *(max(1, cores // count) for count in counts)})


def _process_counts(cfg: DictConfig, cores: int) -> list[int]:
    """The process counts to rank: ``trainer.devices`` when set, else every power of two up to
    ``layout.processes`` (``auto``: the CPU cores)."""
    devices = cfg.trainer.get("devices")
    if devices not in (None, "auto"):
        return [int(devices)]
    most = cfg.layout.get("processes", "auto")
    return _up_to(cores if most in (None, "auto") else int(most))


def _up_to(most: int) -> list[int]:
    """The process counts ranked for at most ``most`` processes: every power of two from 2 (one process is always
    ranked too)."""
    return [n for n in (2, 4, 8, 16, 32, 64) if n <= most] or [1]


def _says_its_batch(datamodule: Any) -> bool:
    """Whether ``datamodule`` gives what the step times are predicted for: its batch size (``batch_size`` or
    ``max_tokens``) and ``mean_padded_length``."""
    return bool(getattr(datamodule, "mean_padded_length", None)) and bool(
        getattr(datamodule, "batch_size", None) or getattr(datamodule, "max_tokens", None))


def rank_run(cfg: DictConfig, strategy: Any, model: Any, datamodule: Any) -> tuple[list[RankedLayout], str]:
    """Every layout of this run's processes ranked (:func:`rank_layouts_for`, the counts and schedule from
    ``cfg``): those that fit first, fastest predicted first; and the table to print."""
    counts = _process_counts(cfg, cpu_cores())
    exact = cfg.trainer.get("devices") not in (None, "auto")
    return rank_layouts_for(strategy, model, datamodule, counts, str(cfg.schedule.get("name", "1F1B")), exact,
                            precision=str(cfg.trainer.get("precision") or "32-true"),
                            clip=bool(cfg.trainer.get("gradient_clip_val")))


def optimizer_maker(model: Any) -> Callable[[list[torch.Tensor]], torch.optim.Optimizer] | None:
    """What makes ``model``'s optimizer over other tensors, to time its step: the class and settings its
    ``configure_optimizers`` returns (the first optimizer), with :func:`~lightning_mp_lstm.models.optimizer_kernels.
    kernel_options` where the settings choose no kernel, as the model's own do on a real device (a model on the meta
    device chooses none; on CPU, Adam's fused step took 19 ms over 16 M parameters where its loop took 85 ms).
    ``None`` (SGD is timed) where ``configure_optimizers`` fails without a Trainer or returns no optimizer."""
    try:
        configured = model.configure_optimizers()
    except Exception:  # noqa: BLE001 - any user code; the step is then timed with SGD
        return None
    while isinstance(configured, (list, tuple, dict)) and configured:
        configured = configured["optimizer"] if isinstance(configured, dict) else configured[0]
    if not isinstance(configured, torch.optim.Optimizer):
        return None
    kind, settings = type(configured), dict(configured.defaults)

    def make(tensors: list[torch.Tensor]) -> torch.optim.Optimizer:
        chosen = {} if settings.get("fused") or settings.get("foreach") is not None else kernel_options(tensors)
        accepted = inspect.signature(kind).parameters
        return kind(tensors, **{**settings, **{k: v for k, v in chosen.items() if k in accepted}})

    try:
        make([torch.zeros(1, requires_grad=True)])
    except Exception:  # noqa: BLE001 - settings its constructor does not take back
        return None
    return make


def rank_layouts_for(strategy: Any, model: Any, datamodule: Any, counts: list[int], schedule: str = "1F1B",
                     exact: bool = False, precision: str = "32-true",
                     clip: bool = False) -> tuple[list[RankedLayout], str]:
    """Every layout of ``counts`` processes (and one process; with ``exact``, only those of ``counts[0]`` where
    any) ranked for ``model`` on ``datamodule``'s batches (:func:`~lightning_mp_lstm.planning.autopilot.
    rank_layouts`), with ``strategy``'s memory budget (replicas that shard where replicated ones do not fit and
    ``strategy`` allows it at ``precision``); and the table to print, with a line that says what was ranked. Times
    blocks, threads and the model's optimizer step (:func:`optimizer_maker`; ``clip``: after clipping the
    gradients' norm) on the CPU; the step costs and the replicas' collectives come from
    :func:`~lightning_mp_lstm.app.step_cost.step_costs` (measured once per machine)."""
    started = time.perf_counter()
    # Before the timing runs: what they leave in this process's heap no rank process holds (4 processes' crowding
    # runs had put the 50,000-word job's floor, and every plan with it, 95 MiB higher).
    floor = process_floor()
    device = torch.device("cpu")
    cores = cpu_cores()
    length = max(1, round(float(datamodule.mean_padded_length)))
    rows = datamodule.batch_size or max(1, int(datamodule.max_tokens) // length)
    blocks = pipeline_model(model)
    costs = step_costs(counts)
    calibration = calibrate(model, rows, length, device, threads=candidate_threads(cores, counts),
                            processes=[c for c in counts if c > 1], optimizer=optimizer_maker(model), clip=clip)
    calibration = replace(calibration, step_costs=tuple((k, v) for k, v in costs.items() if k[0] not in COLLECTIVES),
                          collectives=tuple((k, v) for k, v in costs.items() if k[0] in COLLECTIVES))
    ranked = rank_layouts(
        model, counts, rows, length, device, calibration, memory=model_memory(blocks, model),
        batch_for=lambda layout: largest_batch(datamodule, layout), floor=floor,
        budget_for=lambda layout: strategy.memory_budget(device, layout.world_size),
        schedule=schedule, cores=cores, shard=strategy.may_shard(precision))
    if exact:
        ranked = [r for r in ranked if r.processes == counts[0]] or ranked
    table = (f"mp_lstm: layout=auto ranked {len(ranked)} layouts of up to {max(counts)} processes on {cores} cores "
             f"(a global batch of {rows} x {length} tokens; {time.perf_counter() - started:.1f} s):\n"
             f"{render_ranking(ranked, rows * length)}\ncalibrated: {calibration.summary()}")
    return ranked, table


def choose_layout(cfg: DictConfig, strategy: Any, model: Any, datamodule: Any) -> dict[str, Any] | None:
    """Rank the layouts for this run, print the table and return the settings of the fastest that fits
    (:func:`apply_choice` puts them in ``cfg``); ``None``: the run keeps its layout (a line says why). Where none
    fits, the settings of the one that needs the least memory: the strategy's check before launch then refuses it
    with its memory table and what to change."""
    device = _planning_device(cfg)
    if device.type != "cpu":
        print(f"mp_lstm: layout=auto times layouts on CPUs only; on {device.type} it runs one pipeline over the "
              "devices (choose another with layout=dp2, pp2, ...)")
        return None
    if not _says_its_batch(datamodule):
        print(f"mp_lstm: layout=auto runs one pipeline without ranking layouts: the data module "
              f"({type(datamodule).__name__}) does not say its batch size (batch_size or max_tokens) and "
              "mean_padded_length, which the step times are predicted for")
        return None
    ranked, table = rank_run(cfg, strategy, model, datamodule)
    print(table)
    best = choose(ranked)
    if not best.fits:
        print(f"mp_lstm: no layout fits in memory; {best.name} needs the least, and its check says what to change")
    else:
        fastest = fastest_that_fits(ranked)
        assert fastest is not None  # the pick fits
        why = ("" if best.processes > 1 else " (one process is predicted fastest here)" if best is fastest else
               f" (one process is predicted within {TIE:.0%} of the fastest, {fastest.name}: a tie)")
        print(f"mp_lstm: training on {best.name}{why}")
    return best.settings()


def auto_strategy(model: Any, datamodule: Any, processes: int | str = "auto",
                  **options: Any) -> tuple[Any, int]:
    """The autopilot for a ``Trainer`` you build: the strategy and number of devices of the fastest layout that fits.

    Ranks every layout of one process and of each power of two up to ``processes`` processes for ``model`` on
    ``datamodule``'s batches, as ``python train.py layout=auto`` does, prints the table, and returns an
    ``MPLSTMStrategy`` set to the pick with ``options`` and the pick's process count::

        strategy, devices = auto_strategy(model, datamodule)
        trainer = pl.Trainer(strategy=strategy, devices=devices, accelerator="cpu")
        trainer.fit(model, datamodule=datamodule)

    The rank processes the strategy starts run the script again; there this returns the launching process's choice
    (handed on in :data:`CHOICE`) without timing anything, so every process runs the same layout.

    Args:
        model: the LightningModule, with a pipeline declaration (possibly built on the meta device).
        datamodule: a data module that says its batch (``batch_size`` or ``max_tokens``, and
            ``mean_padded_length``, as ``LMDataModule`` does); set up here for ``fit`` if it is not yet.
        processes: the most processes (``"auto"``: this machine's CPU cores).
        options: other ``MPLSTMStrategy`` options (not the layout's: :data:`CHOSEN_OPTIONS`). A pick whose
            replicas shard their stages (``shard_replicas=True``, ranked where replicated ones do not fit) runs with
            the Trainer's ``precision`` "32-true" (its default) or "bf16-mixed". The steps are predicted without
            gradient clipping (the Trainer's default ``gradient_clip_val``).

    Raises:
        ValueError: ``options`` fix part of the layout, ``processes`` is not a positive count or ``"auto"``, or the
            data module does not say its batch.
    """
    from lightning_mp_lstm.strategy.strategy import MPLSTMStrategy

    fixed = sorted(set(options) & set(CHOSEN_OPTIONS))
    if fixed:
        raise ValueError(f"auto_strategy chooses {', '.join(CHOSEN_OPTIONS)}; got {', '.join(fixed)}: pass the "
                         "layout to MPLSTMStrategy yourself to fix it")
    if processes != "auto" and (isinstance(processes, bool) or not isinstance(processes, int) or processes < 1):
        raise ValueError(f"processes must be a positive number of processes or 'auto', got {processes!r}")
    settings = inherited_choice()
    if settings is None:
        if getattr(datamodule, "mean_padded_length", None) is None:
            datamodule.prepare_data()
            datamodule.setup("fit")
        if not _says_its_batch(datamodule):
            raise ValueError(f"auto_strategy needs a data module that says its batch size (batch_size or max_tokens) "
                             f"and mean_padded_length, which the step times are predicted for; "
                             f"{type(datamodule).__name__} does not")
        counts = _up_to(cpu_cores() if processes == "auto" else int(processes))
        ranked, table = rank_layouts_for(MPLSTMStrategy(**options), model, datamodule, counts)
        print(table)
        best = choose(ranked)
        print(f"mp_lstm: {'training on' if best.fits else 'no layout fits in memory; the least needs'} {best.name}")
        settings = best.settings()
        os.environ[CHOICE] = json.dumps(settings)
    chosen = {k: v for k, v in settings.items() if v is not None}
    return MPLSTMStrategy(**options, **chosen), settings["data_parallel_size"] * settings["pipeline_parallel_size"]


def _layout_values(settings: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The config groups' values of a choice."""
    return {
        "layout": {"data_parallel_size": settings["data_parallel_size"],
                   "pipeline_parallel_size": settings["pipeline_parallel_size"], "tensor_parallel_size": 1},
        "schedule": {"name": settings["schedule"], "n_microbatches": settings["n_microbatches"],
                     "time_chunks": settings.get("time_chunks")},
        "strategy": {"shard_replicas": bool(settings.get("shard_replicas"))},
    }


def apply_choice(cfg: DictConfig, settings: dict[str, Any]) -> None:
    """Set ``cfg``'s layout and schedule groups to a choice, and hand it to the rank processes this process starts
    (:data:`CHOICE`). The layout is checked as the strategy will check it."""
    ParallelLayout.resolve(settings["data_parallel_size"] * settings["pipeline_parallel_size"],
                           settings["data_parallel_size"], settings["pipeline_parallel_size"], None,
                           settings["schedule"], settings["n_microbatches"], 1, settings.get("time_chunks"))
    with open_dict(cfg):
        for group, values in _layout_values(settings).items():
            for key, value in values.items():
                cfg[group][key] = value
    os.environ[CHOICE] = json.dumps(settings)


def inherited_choice() -> dict[str, Any] | None:
    """The launching process's choice, in a rank process it started (``None`` elsewhere)."""
    if CHECKED_BY not in os.environ or CHOICE not in os.environ:
        return None
    return json.loads(os.environ[CHOICE])


def layout_overrides(settings: dict[str, Any]) -> list[str]:
    """``train.py`` overrides that run a choice by hand (what the autopilot would run)."""
    values = _layout_values(settings)
    out = [f"layout.{key}={value}" for key, value in values["layout"].items()]
    if settings["schedule"] == WAVEFRONT:
        out.append("schedule=wavefront")
    out += [f"schedule.name={settings['schedule']}", f"schedule.n_microbatches={settings['n_microbatches']}"]
    if settings.get("time_chunks"):
        out.append(f"schedule.time_chunks={settings['time_chunks']}")
    if settings.get("shard_replicas"):
        out.append("strategy.shard_replicas=true")
    return out

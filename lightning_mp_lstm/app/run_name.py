"""The name of a run's folder (``train.py``'s ``hydra.run.dir``): unique per run, the same for every rank of it.

Hydra's ``outputs/<date>/<HH-MM-SS>`` is shared by runs started in the same second: their ``metrics.csv`` rows,
timelines and checkpoints mix. :func:`run_name` adds the sub-second start time and the process id of the process
that started the run. That is this process for ``python train.py`` (Lightning's launcher gives its rank processes
the folder it chose); under ``torchrun`` or ``srun`` every rank is started by the same launcher process of its node
(its parent), so every rank of a node takes the launcher's pid and start time, and the run gets one folder per node,
not one per rank.
"""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

from omegaconf import OmegaConf

__all__ = ["RESOLVER", "register_resolver", "run_name"]

#: The resolver's name in configs: ``hydra.run.dir: outputs/${now:%Y-%m-%d}/${mp_lstm.run_name:}``.
RESOLVER = "mp_lstm.run_name"
#: Variables that say an external launcher (``torchrun``, ``srun``) started this process as one of the run's ranks.
_LAUNCHED_BY = ("TORCHELASTIC_RUN_ID", "SLURM_PROCID")


def _started(pid: int) -> datetime | None:
    """When process ``pid`` started (Linux ``/proc``, 10 ms resolution), or ``None`` where that cannot be read."""
    try:
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return datetime.fromtimestamp(boot + ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def run_name() -> str:
    """``<HH-MM-SS.ffffff>_<pid>`` of the process that started the run: this one, or, in a rank started by
    ``torchrun`` or ``srun``, its parent, the launcher (``launcher_<pid>`` where the launcher's start time cannot
    be read)."""
    if any(key in os.environ for key in _LAUNCHED_BY):
        parent = os.getppid()
        started = _started(parent)
        return f"{started:%H-%M-%S.%f}_{parent}" if started is not None else f"launcher_{parent}"
    return f"{datetime.now():%H-%M-%S.%f}_{os.getpid()}"


def register_resolver() -> None:
    """Make ``${mp_lstm.run_name:}`` available to configs (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, run_name, use_cache=True)

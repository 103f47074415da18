"""Run a function on several local processes under a deadline, and find the PTB files.

For equivalence tests and benchmarks of your own: run the same training on a few CPU ranks and compare what
each rank returns with a one-process reference. Nothing here depends on a test framework.

Example::

    from lightning_mp_lstm.base.testing import run_ranks

    def fit(rank: int, world_size: int, steps: int) -> dict:
        ...  # build a Trainer with devices=world_size and MPLSTMStrategy, fit, return what to compare

    per_rank = run_ranks(fit, 2, 5, timeout=180)
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

__all__ = ["FORKSERVER_PRELOAD", "PTB_ENV", "START_METHODS", "free_port", "ptb_dir", "run_ranks"]

#: How :func:`run_ranks` may start its processes (``fork`` is left out: a forked pytest or Trainer process
#: carries its threads' locks into the child).
START_METHODS = ("spawn", "forkserver")
#: What the forkserver imports once, before it forks any rank (``start_method="forkserver"``).
FORKSERVER_PRELOAD = ["torch", "torch.distributed.pipelining", "lightning.pytorch", "lightning_mp_lstm"]
#: The environment variable that overrides where the PTB files are.
PTB_ENV = "LIGHTNING_MP_LSTM_PTB_DIR"


def ptb_dir(root: Path) -> Path:
    """The directory with ``ptb.valid.txt`` and ``ptb.test.txt``.

    Args:
        root: the repository root; without ``$LIGHTNING_MP_LSTM_PTB_DIR`` the files are looked for in its
            ``data/ptb`` (PTB's valid and test splits ship with the repository).

    Returns:
        ``$LIGHTNING_MP_LSTM_PTB_DIR`` when it is set, else ``<root>/data/ptb``.

    Raises:
        FileNotFoundError: when either file is missing there (naming the directory and the variable to set).
    """
    path = Path(os.environ.get(PTB_ENV) or Path(root) / "data" / "ptb")
    missing = [name for name in ("ptb.valid.txt", "ptb.test.txt") if not (path / name).is_file()]
    if missing:
        raise FileNotFoundError(f"PTB files {missing} not found in {path}; set {PTB_ENV} to their directory")
    return path


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago.

    Returns:
        The port number (another process may take it before you bind it).
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, args: tuple,
           environment: dict[str, str]) -> None:
    """One started rank: take the caller's environment, set the launcher's, run ``fn`` on one thread, pickle its
    result."""
    # A forkserver's child inherits the server's environment as it was when the server started; the caller's now is
    # what a spawned rank would see.
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world_size), RANK=str(rank),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size), NODE_RANK="0")
    torch.set_num_threads(1)
    result = fn(rank, world_size, *args)
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0,
              allow_missing: bool = False, start_method: str = "spawn") -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes and return their results.

    The ranks find each other through the ``MASTER_ADDR``/``MASTER_PORT``/``RANK`` environment, the same
    variables ``torchrun`` sets, so Lightning treats them as externally launched: give the Trainer
    ``devices=world_size``. Every rank runs one CPU thread.

    Args:
        fn: a module-level (picklable) function; its result must pickle too.
        world_size: the number of processes.
        *args: passed to ``fn`` after ``rank`` and ``world_size``.
        timeout: seconds the ranks may take together; ranks still alive then are killed.
        allow_missing: a rank that died without a result (killed on purpose) gives ``None`` instead of
            failing the call.
        start_method: ``"spawn"`` (a fresh interpreter per rank: each imports torch and Lightning, seconds per
            rank) or ``"forkserver"`` (ranks forked from one server process, started at the first such call with
            :data:`FORKSERVER_PRELOAD` imported once, so a rank starts in milliseconds; a server this process
            started earlier keeps what it preloaded). Either way a rank sees the caller's environment as it is at
            the call.

    Returns:
        Every rank's result, in rank order.

    Raises:
        ValueError: ``start_method`` is not one of :data:`START_METHODS`.
        TimeoutError: the ranks did not finish within ``timeout``.
        torch.multiprocessing.ProcessRaisedException: a rank raised (the message holds its traceback).
        torch.multiprocessing.ProcessExitedException: a rank died without raising (killed, or a crash).
    """
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r}; allowed: {', '.join(START_METHODS)}")
    if start_method == "forkserver":
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)  # no effect once the server runs
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, free_port(), out_dir, args, dict(os.environ)),
                                 nprocs=world_size, join=False, start_method=start_method)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if allow_missing:
                    # Not ctx.join(): it SIGTERMs every other rank as soon as one exits with an error.
                    if not any(p.is_alive() for p in ctx.processes):
                        break
                    time.sleep(0.2)
                elif ctx.join(timeout=1):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks of {fn.__name__} did not finish in {timeout:.0f} s")
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(world_size):
            path = Path(out_dir, f"rank{rank}.pkl")
            results.append(pickle.loads(path.read_bytes()) if path.exists() or not allow_missing else None)
        return results

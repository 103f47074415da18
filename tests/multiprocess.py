"""Run a function on several local processes (gloo) under a deadline; kill every rank on expiry."""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A TCP port on localhost that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
    )
    torch.set_num_threads(1)
    result = fn(rank, world_size, *args)
    Path(out_dir, f"rank{rank}.pkl").write_bytes(pickle.dumps(result))


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned processes and return their results.

    The ranks find each other through the ``MASTER_ADDR``/``MASTER_PORT``/``RANK`` environment, the same
    variables ``torchrun`` sets (so Lightning treats them as externally launched). A rank that raises
    fails the call with its traceback; ranks still alive at the deadline are killed.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _entry, args=(fn, world_size, free_port(), out_dir, args), nprocs=world_size, join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks of {fn.__name__} did not finish in {timeout:.0f} s")
        finally:
            for process in ctx.processes:
                if process.is_alive():
                    process.kill()
        return [pickle.loads(Path(out_dir, f"rank{r}.pkl").read_bytes()) for r in range(world_size)]


def run_command(args: list[str], timeout: float, **env: str) -> subprocess.CompletedProcess:
    """Run ``args`` from the repository root in its own process group, one CPU thread per process.

    Whatever it launches (Lightning's rank processes, torchrun workers) is killed with it if it outlives
    ``timeout``; the call then raises ``TimeoutError`` with the tail of the output.
    """
    proc = start_command(args, **env)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise TimeoutError(f"{' '.join(args)} did not finish in {timeout:.0f} s; output:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(args, proc.returncode, out, None)


def start_command(args: list[str], **env: str) -> subprocess.Popen:
    """Start ``args`` like :func:`run_command` does, without waiting; kill it with ``os.killpg``."""
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **env}
    environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), environment.get("PYTHONPATH")]))
    return subprocess.Popen(args, cwd=ROOT, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)

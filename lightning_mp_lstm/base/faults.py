"""When something goes wrong on one rank: every rank raises the same error, and a lost peer is named.

Two situations, two tools:

* Work that runs on one rank while the others wait for its result (planning on rank 0, writing a checkpoint)
  or on every rank before a collective: :func:`result_from` and :func:`everywhere` share the outcome, an
  exception included, so every rank raises the same message within seconds instead of waiting for a peer
  that already gave up.
* A peer that died (``SIGKILL``, out of memory), stopped (``SIGSTOP``) or failed somewhere no collective protects:
  the survivors' next collective fails after the process-group timeout at most, with a transport message
  ("Connection closed by peer [127.0.0.1]:29500") that names no rank. :class:`PeerDirectory` remembers every
  rank's host and pid and the failures ranks report (:func:`describe`: never an empty reason), and turns that
  message into one that names the failed rank.
"""

from __future__ import annotations

import os
import pickle
import re
import socket
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = ["PeerDirectory", "describe", "everywhere", "forget_object_groups", "gather", "looks_like_lost_peer",
           "object_group", "point_to_point_group", "result_from", "setup_object_group"]

T = TypeVar("T")

_FAILURE_KEY = "mp_lstm/failure/{rank}"
_EXPLAINED_KEY = "mp_lstm/lost_peer/{rank}"
# What gloo and nccl say when a peer is gone or silent (the text, not the type, is stable across versions).
_LOST_PEER = re.compile(
    r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out|timed out|Socket Timeout"
    r"|NCCL communicator was aborted|Watchdog caught collective operation timeout|ProcessGroupNCCL.*(timeout|abort)"
    r"|connection refused|Connection refused|recvBytes|sendBytes",
)


def _initialized() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


_OBJECT_GROUP: dict[str, Any] = {"group": None, "point_to_point": None}


def setup_object_group() -> None:
    """Make the process groups that carry pickled objects (plans, errors, checkpoints gathered on rank 0, timeline
    spans): with a default backend other than gloo (nccl), a gloo group over every rank, so objects travel through
    host memory instead of being staged in GPU memory through NCCL communicators; with gloo, the default group. And a
    gloo group of every rank for objects sent from one rank to another (:func:`point_to_point_group`).

    A collective: every rank calls it once the default process group exists (the strategy's ``setup_environment``).
    """
    gloo = dist.get_backend() == "gloo"
    _OBJECT_GROUP["group"] = None if gloo else dist.new_group(backend="gloo")
    _OBJECT_GROUP["point_to_point"] = dist.new_group(backend="gloo")


def forget_object_groups() -> None:
    """Drop the references to the groups :func:`setup_object_group` made (once the process groups are destroyed: a
    group's worker threads end when the last reference to it goes)."""
    _OBJECT_GROUP.update(group=None, point_to_point=None)


def object_group() -> dist.ProcessGroup | None:
    """The group for object collectives over every rank (``None``: the default group): see
    :func:`setup_object_group`."""
    return _OBJECT_GROUP["group"] if dist.is_available() and dist.is_initialized() else None


def point_to_point_group() -> dist.ProcessGroup | None:
    """The gloo group for objects one rank sends to another (``send_object_list`` / ``recv_object_list``), apart
    from :func:`object_group`'s collectives (``None`` before :func:`setup_object_group`: the default group).

    gloo counts sends and receives in a group's sequence number. A rank that receives from every other (rank 0
    gathering a checkpoint) would then run the group's next collectives under another sequence number than its peers:
    harmless for gloo itself, but a mismatch for ``TORCH_DISTRIBUTED_DEBUG=DETAIL``'s collective checks.
    """
    return _OBJECT_GROUP["point_to_point"] if dist.is_available() and dist.is_initialized() else None


def describe(error: BaseException) -> str:
    """``Type: message``; for an error without a message (``RuntimeError()``, a ``SystemExit``), where it was raised
    and the error it was raised from, so that a report never reads ``RuntimeError:`` and nothing else."""
    name = type(error).__name__
    if str(error):
        return f"{name}: {error}"
    frames = traceback.extract_tb(error.__traceback__)
    where = f" at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name}" if frames else ""
    cause = error.__cause__ or error.__context__
    return f"{name} (no message){where}" + (f", raised from {describe(cause)}" if cause is not None else "")


def _portable(error: BaseException) -> BaseException:
    """``error`` if it survives pickling, else a ``RuntimeError`` with its type and message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001  (any pickling failure)
        return RuntimeError(describe(error))


def _raise_shared(error: BaseException, rank: int) -> None:
    error.add_note(f"(raised on global rank {rank}; every rank raises it)")
    raise error


def result_from(src: int, fn: Callable[[], T]) -> T:
    """Run ``fn`` on global rank ``src`` only; every rank returns its result or raises its exception.

    Without a process group (one process) ``fn`` just runs.
    """
    if not _initialized():
        return fn()
    outcome: list[Any] = [None]
    if dist.get_rank() == src:
        try:
            outcome[0] = ("ok", fn())
        except Exception as error:  # noqa: BLE001  (shared with every rank, then re-raised here too)
            outcome[0] = ("error", _portable(error))
            dist.broadcast_object_list(outcome, src, group=object_group())
            raise
    dist.broadcast_object_list(outcome, src, group=object_group())
    kind, value = outcome[0]
    if kind == "error":
        _raise_shared(value, src)
    return value


def gather(fn: Callable[[], T], group: dist.ProcessGroup | None = None) -> list[T]:
    """Run ``fn`` on every rank of ``group`` and return every rank's result, in rank order; if it raises on any
    rank, every rank raises the exception of the lowest failing rank (one collective either way)."""
    if not _initialized():
        return [fn()]
    try:
        outcome: Any = ("ok", fn())
    except Exception as error:  # noqa: BLE001  (shared below)
        outcome = ("error", _portable(error))
    group = group if group is not None else object_group()
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, outcome, group=group)
    for rank, (kind, value) in enumerate(gathered):
        if kind == "error":
            global_rank = dist.get_global_rank(group, rank) if group is not None else rank
            _raise_shared(value, global_rank)
    return [value for _, value in gathered]


def everywhere(fn: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """Run ``fn`` on every rank of ``group``; if it raises on any rank, every rank raises the exception of the
    lowest failing rank. Use it around local work that is followed by a collective."""
    if not _initialized():
        return fn()
    return gather(fn, group)[dist.get_rank(group)]


def looks_like_lost_peer(error: BaseException) -> bool:
    """Whether ``error`` is what a collective raises when a peer died, hung or closed its connection."""
    if isinstance(error, getattr(dist, "DistError", ())) and not isinstance(error, ValueError):
        return True
    return isinstance(error, RuntimeError) and bool(_LOST_PEER.search(str(error)))


@dataclass(frozen=True)
class _Peer:
    rank: int
    host: str
    pid: int


def _state(pid: int) -> str:
    """The state of process ``pid`` of this host: ``"gone"`` (a zombie counts), ``"stopped"`` (``SIGSTOP``, Ctrl-Z,
    a debugger) or ``"running"`` (also when it cannot be told)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "gone"
    except PermissionError:
        return "running"
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "running"
    return {"Z": "gone", "X": "gone", "T": "stopped", "t": "stopped"}.get(state, "running")


@contextmanager
def _native_stderr_silenced() -> Iterator[None]:
    """The process's stderr (file descriptor 2) sent to ``os.devnull`` for a moment: a call to a store whose server
    died while :func:`_listening` was asked writes a C++ stack dump there (torch's ``TCPStore`` warning), before the
    message this module is composing."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _listening(store: Any) -> bool:
    """Whether the server of a TCP store (under any prefix stores) still accepts connections; other stores: yes.

    Asked before every use: a c10d store whose server has gone prints a C++ stack dump for every call."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if not isinstance(host, str) or not isinstance(port, int):
        return True
    try:
        with socket.create_connection((host, port), timeout=1.0):
            return True
    except OSError:
        return False


class PeerDirectory:
    """Every rank's host and pid, and the failures ranks report, to name the rank a survivor lost.

    Create it on every rank right after the process group exists (:meth:`gather` is a collective).

    The reports travel through the process group's store, which rank 0 hosts (unless ``torchrun``'s agent does):
    a survivor that notices its loss only after rank 0 has ended cannot read them, and names what it can see.
    """

    def __init__(self, peers: list[_Peer], rank: int) -> None:
        self.peers = peers
        self.rank = rank

    @classmethod
    def gather(cls) -> PeerDirectory:
        """Exchange host names and pids over the default process group."""
        me = _Peer(dist.get_rank(), socket.gethostname(), os.getpid())
        peers: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(peers, me, group=object_group())
        return cls(peers, me.rank)

    @staticmethod
    def _store() -> Any:
        """The process group's store, or ``None`` when there is none or its server (rank 0's) has gone."""
        try:
            store = dist.distributed_c10d._get_default_store()
        except Exception:  # noqa: BLE001  (no store: nothing to report to)
            return None
        return store if _listening(store) else None

    def _set(self, key: str, value: str) -> None:
        store = self._store()
        if store is None:
            return
        try:
            with _native_stderr_silenced():
                store.set(key.format(rank=self.rank), value)
        except Exception:  # noqa: BLE001  (the store lives on rank 0, which may be gone)
            pass

    def report_failure(self, error: BaseException) -> None:
        """Tell the other ranks (through the process group's store) that this rank failed, and why."""
        self._set(_FAILURE_KEY, describe(error)[:800])

    def _read(self, key: str) -> dict[int, str]:
        """Every other rank's value of ``key`` (``{rank}`` in it), for the ranks that set it."""
        store = self._store()
        found: dict[int, str] = {}
        if store is None:
            return found
        with _native_stderr_silenced():
            for peer in self.peers:
                name = key.format(rank=peer.rank)
                try:
                    if peer.rank != self.rank and store.check([name]):
                        found[peer.rank] = store.get(name).decode(errors="replace")
                except Exception:  # noqa: BLE001  (store unreachable)
                    break
        return found

    def _in_state(self, state: str) -> list[_Peer]:
        host = socket.gethostname()
        return [p for p in self.peers if p.rank != self.rank and p.host == host and _state(p.pid) == state]

    def lost_peers(self, wait: float = 2.0) -> list[str]:
        """What is known of the ranks that failed: a failure they reported, their process gone, or stopped.

        A rank that only lost a peer itself (and said so) is not a cause: it is left out. A failing rank reports a
        moment after its peers may notice it, so this polls for up to ``wait`` s.
        """
        deadline = time.monotonic() + wait
        while True:
            reported, explained = self._read(_FAILURE_KEY), self._read(_EXPLAINED_KEY)
            dead, stopped = self._in_state("gone"), self._in_state("stopped")
            found = []
            for peer in self.peers:
                where = f"rank {peer.rank} (pid {peer.pid} on {peer.host})"
                if peer.rank in reported:
                    found.append(f"{where} failed with {reported[peer.rank]}")
                elif peer in dead and peer.rank not in explained:
                    found.append(f"{where} is no longer running (killed or crashed)")
                elif peer in stopped:
                    found.append(f"{where} is stopped (SIGSTOP, Ctrl-Z or a debugger) and does not answer")
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.2)

    def explain(self, error: BaseException) -> None:
        """Rewrite a lost-peer ``error`` in place so it names the failed rank(s), and tell the others this rank only
        lost a peer; report other errors as this rank's own failure."""
        if not looks_like_lost_peer(error):
            self.report_failure(error)
            return
        lost = self.lost_peers()
        if lost:
            summary = "; ".join(lost)
        else:
            summary = "no rank reported a failure and every rank on this host is running (one may be stuck)"
        self._set(_EXPLAINED_KEY, summary[:800])
        message = f"mp_lstm: rank {self.rank} stopped because it lost a peer: {summary}. Transport error: {error}"
        error.args = (message, *error.args[1:])

"""Starting the rank processes of one job, and ending them so another job can start in the same process.

Lightning's :class:`~lightning.pytorch.strategies.launchers._SubprocessScriptLauncher` assumes one job per
program: the children re-run ``sys.argv`` (under a Hydra multirun that is the whole sweep again, ``-m`` and
all), and after the job the launching process keeps the default process group and the ``LOCAL_RANK`` /
``MASTER_PORT`` / ... environment, so a second ``Trainer`` in the same process would neither spawn nor
initialize anything. :class:`JobLauncher` starts children that run *this job only* and, in
:meth:`JobLauncher.release`, undoes what the launch left behind. Before it starts any, it makes sure the port the
job's rank 0 will listen on is free (:func:`port_in_use`): a ``MASTER_PORT`` another run holds is refused by name
(torch would fail later with a bare ``EADDRINUSE``), and a port chosen for the job that was taken since is chosen
again.
"""

from __future__ import annotations

import errno
import os
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port
from lightning.fabric.strategies.launchers.subprocess_script import _basic_subprocess_cmd, _ChildProcessObserver
from lightning.fabric.utilities.rank_zero import _get_rank, rank_prefixed_message
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

from lightning_mp_lstm.strategy.pipeline_setup import end_process_groups

__all__ = ["CHECKED_BY", "LAUNCHED_AT", "PRIVATE_API", "JobLauncher", "PortInUseError", "count_job_call",
           "hydra_job_command", "hydra_quote", "job_released", "port_in_use"]

#: The private names of Lightning and Hydra this launcher builds on, as Lightning's own subprocess launcher does (it
#: parses Hydra's flags with the same ``get_args_parser``): module -> names, and for a class the attributes it relies
#: on. ``tests/test_architecture.py`` checks each is still there, so a Lightning or Hydra that renames one fails there,
#: by name, before any launch does.
PRIVATE_API: dict[str, dict[str, tuple[str, ...]]] = {
    "lightning.pytorch.strategies.launchers": {
        "_SubprocessScriptLauncher": ("launch", "_call_children_scripts", "_check_can_spawn_children"),
    },
    "lightning.fabric.strategies.launchers.subprocess_script": {
        "_basic_subprocess_cmd": (), "_ChildProcessObserver": ("_child_processes",),
    },
    "hydra._internal.utils": {"get_args_parser": ()},
}

#: Environment variables a launch sets in the launching process (Lightning's ``_call_children_scripts``, and
#: ``OMP_NUM_THREADS`` from ``_set_num_threads_if_needed`` when it was unset).
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS")
#: Set, for rank processes that re-run a plain script (not a Hydra job), to the number of the script's call (its
#: ``fit``/``validate``/``test``/``predict`` calls under ``mp_lstm``, in order: :func:`count_job_call`) they were
#: started for: one that reaches an earlier call first would pair its job with another of the launching process.
LAUNCHED_AT = "MP_LSTM_LAUNCHED_AT"
#: This process's calls so far, and whether its job was released (a rank process after ``strategy.shutdown()``).
_CALLS = {"count": 0, "released": False}
#: Set (to the launching process's pid) in the environment of the rank processes a :class:`JobLauncher` starts: the
#: launching process checked the job before starting them (``train.py``'s checks before launch need not run again).
CHECKED_BY = "MP_LSTM_CHECKED_BY"


class PortInUseError(RuntimeError):
    """The port given for the job's rank 0 to listen on (``MASTER_PORT``) is held by another process."""


def port_in_use(port: int) -> bool:
    """Whether a process of this machine listens on TCP ``port``: binding it fails with ``EADDRINUSE`` (with
    ``SO_REUSEADDR``, as torch's store binds, so a port whose last connection is closing still counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("", port))
        except OSError as error:
            return error.errno == errno.EADDRINUSE
    return False

#: Hydra settings the children get from :func:`hydra_job_command` itself, or that only make sense for a sweep.
_HYDRA_KEYS_SET_FOR_CHILDREN = (
    "hydra.mode", "hydra.run.dir", "hydra.output_subdir", "hydra.job.name",
    "hydra.sweep", "hydra.sweeper", "hydra/sweeper", "hydra.launcher", "hydra/launcher",
)


def hydra_quote(text: str) -> str:
    """``text`` as a single-quoted Hydra override value that parses back to exactly ``text``.

    Needed for paths with characters Hydra's override grammar treats specially: ``,`` (a sweep), spaces,
    ``=``, ``:``, brackets, quotes... A common real case is ``hydra.sweep.subdir=${hydra.job.override_dirname}``,
    which makes job directories such as ``layout=pp2,seed=1``. Inside quotes a backslash run is literal unless
    it precedes a quote (or ends the string), where it is doubled; ``${`` is escaped so the path is never
    resolved as an interpolation.
    """
    out: list[str] = []
    i, n = 0, len(text)
    while i < n:
        j = i
        while j < n and text[j] == "\\":
            j += 1
        slashes = j - i
        if j == n:  # trailing backslashes: the closing quote follows
            out.append("\\" * (2 * slashes))
        elif text[j] == "'":
            out.append("\\" * (2 * slashes) + "\\'")
            j += 1
        elif text.startswith("${", j):
            out.append("\\" * (2 * slashes) + "\\${")
            j += 2
        else:
            out.append("\\" * slashes + text[j])
            j += 1
        i = j
    return "'" + "".join(out) + "'"


def _program() -> list[str]:
    """The command that started this program: the script's absolute path, or ``-m module`` (as Lightning)."""
    from hydra.utils import to_absolute_path

    import __main__  # local import, as in Lightning (https://github.com/Lightning-AI/pytorch-lightning/issues/15218)

    if __main__.__spec__ is None:
        return [sys.executable, to_absolute_path(sys.argv[0])]
    return [sys.executable, "-m", __main__.__spec__.name]


def _config_arguments(argv: Sequence[str]) -> list[str]:
    """``--config-path`` / ``--config-name`` / ``--config-dir`` of this program's command line, if given."""
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(list(argv))
    out: list[str] = []
    for flag, value in (("--config-path", args.config_path), ("--config-name", args.config_name),
                        ("--config-dir", args.config_dir)):
        if value is not None:
            out.append(f"{flag}={value}")
    return out


def _override_key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def hydra_job_command(local_rank: int) -> list[str]:
    """The command of one child rank of the current Hydra job (call it inside a running Hydra job).

    The same program with the same config source, this job's own task overrides (``hydra.overrides.task``:
    under a multirun Hydra has already written them out in its own override syntax, quoted and escaped;
    under a single run they are the command line as given, which Hydra parsed once already), the command
    line's ``hydra.*`` settings except those of the sweep, and ``hydra.run.dir`` set to this job's output
    directory. No ``-m``: the child runs this job and nothing else.
    """
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    inherited = [o for o in hydra_cfg.overrides.hydra if not _override_key(o).startswith(_HYDRA_KEYS_SET_FOR_CHILDREN)]
    return [
        *_program(),
        *_config_arguments(sys.argv[1:]),
        *hydra_cfg.overrides.task,
        *inherited,
        f"hydra.run.dir={hydra_quote(str(hydra_cfg.runtime.output_dir))}",
        # The job's config is saved once, by the launching process.
        "hydra.output_subdir=null",
        f"hydra.job.name=train_ddp_process_{local_rank}",
    ]


class JobLauncher(_SubprocessScriptLauncher):
    """Lightning's subprocess launcher, for one job of a program that may run several (a Hydra multirun).

    Args:
        cluster_environment: the strategy's cluster environment.
        num_processes: processes on this node (the launching one included).
        num_nodes: number of nodes.
        release_timeout: seconds :meth:`release` waits for the children to exit before killing them.
        failed_release_timeout: the same after a ``fit``/``validate``/``test`` that raised here: the children
            may be blocked in a collective this process will never join.
        stopped_release_timeout: the same after :meth:`stop_watching` (every rank ends together, after saving).
    """

    def __init__(self, cluster_environment: Any, num_processes: int, num_nodes: int,
                 release_timeout: float = 60.0, failed_release_timeout: float = 5.0,
                 stopped_release_timeout: float = 20.0) -> None:
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.release_timeout = release_timeout
        self.failed_release_timeout = failed_release_timeout
        self.stopped_release_timeout = stopped_release_timeout
        self._failed = False
        self._stopping = False
        self._unwatched: list[subprocess.Popen] = []
        self._saved_env: dict[str, str | None] | None = None
        self._saved_threads: int | None = None

    @override
    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self._saved_env is None and not self.cluster_environment.creates_processes_externally:
            # The first launch of this job spawns; fit/validate/test after it find LOCAL_RANK and do not.
            self._saved_env = {key: os.environ.get(key) for key in LAUNCH_ENV}
            self._saved_threads = torch.get_num_threads()
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        except BaseException:
            self._failed = True
            raise

    @override
    def _call_children_scripts(self) -> None:
        # Lightning's, with the child command of this job only (Lightning re-runs sys.argv[1:]), on a free port.
        self._check_can_spawn_children()
        self.procs = []
        os.environ["MASTER_ADDR"] = self.cluster_environment.main_address
        os.environ["MASTER_PORT"] = str(self._free_port())
        os.environ["NODE_RANK"] = str(self.cluster_environment.node_rank())
        os.environ["LOCAL_RANK"] = str(self.cluster_environment.local_rank())
        os.environ["WORLD_SIZE"] = str(self.num_processes * self.num_nodes)
        hydra_job = _hydra_job_running()
        for local_rank in range(1, self.num_processes):
            env = {**os.environ, "LOCAL_RANK": str(local_rank), CHECKED_BY: str(os.getpid())}
            if hydra_job:
                from hydra.utils import get_original_cwd

                command, cwd = hydra_job_command(local_rank), get_original_cwd()
            else:  # the script again, from its start
                command, cwd = list(_basic_subprocess_cmd()), None
                env[LAUNCHED_AT] = str(_CALLS["count"] + 1)
            self.procs.append(subprocess.Popen(command, env=env, cwd=cwd))

    def _free_port(self) -> int:
        """The port rank 0 of the job will listen on (node 0 only checks it: the others connect to it).

        Raises:
            PortInUseError: ``MASTER_PORT`` was given and another process listens on it.
        """
        environment = self.cluster_environment
        port = environment.main_port
        if environment.node_rank() != 0 or not port_in_use(port):
            return port
        given = (self._saved_env or {}).get("MASTER_PORT")
        if given is not None:
            raise PortInUseError(
                f"MASTER_PORT={given}: port {port} is already in use on this machine: another run (or another "
                "program) listens on it, so this run's rank 0 cannot. Give this run a free port "
                "(MASTER_PORT=<another port>), or unset MASTER_PORT and a free one is chosen")
        for _ in range(20):  # chosen for this job, and taken since (the choice only asked the system for one)
            port = find_free_network_port()
            if not port_in_use(port):
                break
        if hasattr(environment, "_main_port"):  # LightningEnvironment keeps the port it chose: the group uses it
            environment._main_port = port
        return port

    def stop_watching(self) -> None:
        """Every rank of the job is about to end together (stopped on a signal, or an error raised on every rank):
        detach Lightning's child-process observer, which kills every process, this one included, as soon as it sees a
        child that exited with a non-zero status, possibly while this process is still saving or reporting.
        :meth:`release` still waits for the children (at most ``stopped_release_timeout`` seconds)."""
        self._unwatched.extend(self.procs)
        self.procs.clear()  # the observer holds this list: empty, it reads "all exited with 0" and stops
        self._stopping = True

    def release(self) -> None:
        """End this job's processes so a later job in the same process starts a fresh, correctly sized set.

        1. Detach Lightning's child-process observer (it watches ``self.procs`` itself, and kills this process
           when a child ends with a non-zero code, which would end a whole sweep), then wait for the children,
           at most ``release_timeout`` seconds (``failed_release_timeout`` after a failed launch,
           ``stopped_release_timeout`` after :meth:`stop_watching`); kill those still running and warn, as also
           about children that ended with an error (unless the ranks stopped together).
        2. Destroy the process groups (``pipeline_setup.end_process_groups``): Lightning does not initialize a
           group when one exists, and the device mesh checks its size against the old one.
        3. Restore ``MASTER_ADDR``, ``MASTER_PORT``, ``NODE_RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and
           ``OMP_NUM_THREADS`` (removing those that were unset) and torch's thread count: with ``LOCAL_RANK``
           set, Lightning takes the next job's processes as launched from outside and spawns none.
        4. Reset ``rank_zero_only.rank`` to what Lightning computes for this process at import.

        Safe to call twice; on a process that launched nothing (a child rank) it only destroys the group.
        """
        children = [*self._unwatched, *self.procs]
        # Lightning's observer thread holds this very list: emptied, it reads "all exited with 0" and stops at
        # its next poll instead of killing this process when a child fails or is killed below.
        self.procs.clear()
        self._unwatched = []
        stopped, self._stopping = self._stopping, False
        timeout = (self.stopped_release_timeout if stopped
                   else self.failed_release_timeout if self._failed else self.release_timeout)
        deadline = time.monotonic() + timeout
        killed, failed = [], []
        for local_rank, proc in enumerate(children, start=1):
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _join_observers(self.procs)
                proc.kill()
                proc.wait()
                killed.append(proc.pid)
            else:
                if proc.returncode and not stopped:
                    failed.append((local_rank, proc.pid, proc.returncode))
        if killed:
            warnings.warn(
                f"JobLauncher.release: rank processes {killed} were still running {timeout:g} s after "
                f"the job {'failed' if self._failed else 'ended'} and were killed", RuntimeWarning, stacklevel=2,
            )
        if failed:  # in Lightning's observer's words, which no longer watches them (a stop's exit codes are expected)
            warnings.warn("\n".join(
                rank_prefixed_message(f"Child process with PID {pid} terminated with code {code}.", rank)
                for rank, pid, code in failed
            ), RuntimeWarning, stacklevel=2)
        end_process_groups()
        if self._saved_env is not None:
            for key, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            self._saved_env = None
            if self._saved_threads is not None:
                torch.set_num_threads(self._saved_threads)
            self._saved_threads = None
            rank_zero_only.rank = _get_rank() or 0


def count_job_call() -> None:
    """Count a ``fit``/``validate``/``test``/``predict`` call of this process under ``mp_lstm`` (before any
    collective), and refuse one a rank process that re-runs a plain script must not make: Lightning's rank processes
    run the whole script, so they follow the launching process call by call only while its processes live; once it
    released them (``strategy.shutdown()``) it starts new ones for its next call, which would run the script's first
    call beside it (another model or batch), while the old ones would go on to its next.

    Raises:
        RuntimeError: this rank process reached a call before the one it was started for, or a call after its job
            was released.
    """
    _CALLS["count"] += 1
    started_at = os.environ.get(LAUNCHED_AT)
    if started_at is None:
        return
    why = None
    if _CALLS["count"] < int(started_at):
        why = (f"it was started for the script's call number {started_at} (its fit/validate/test/predict calls "
               f"under mp_lstm, in order) but runs the script from its start and reached call number "
               f"{_CALLS['count']} first")
    elif _CALLS["released"]:
        why = (f"its job ended with strategy.shutdown() and the script goes on to call number {_CALLS['count']}, "
               "for which the launching process starts new rank processes")
    if why is not None:
        raise RuntimeError(
            f"mp_lstm: rank process {os.environ.get('LOCAL_RANK')} stops: {why}; it would train another model or batch "
            "than the launching process. In a script, call strategy.shutdown() only after its last multi-process "
            "call (the rank processes then follow the script call by call), or run each job as its own script or "
            "Hydra multirun job")


def job_released() -> None:
    """The job of this process ended (``strategy.shutdown()``): a rank process re-running a script makes no more
    calls (:func:`count_job_call`)."""
    if os.environ.get(LAUNCHED_AT) is not None:
        _CALLS["released"] = True


def _hydra_job_running() -> bool:
    try:
        from hydra.core.hydra_config import HydraConfig
    except ImportError:
        return False
    return HydraConfig.initialized()


def _join_observers(procs: list[subprocess.Popen]) -> None:
    """Wait (briefly) for Lightning's observer threads watching ``procs`` (the same list object, now empty)
    to end, so that none can see a child killed afterwards."""
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver) and thread._child_processes is procs:
            thread.join(timeout=thread._sleep_period + 1)

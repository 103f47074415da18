"""Shared fixtures. Helpers that are plain functions and classes live in ``tests/helpers.py``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from tests.helpers import ROOT, ptb_dir

#: The marker of every test that starts a process (ranks, ``train.py``, scripts, the docs build, the benchmarks).
PROCESSES = "processes"
#: The test running now (the guard of the fast tier names it).
_RUNNING: dict[str, pytest.Item | None] = {"item": None}


def pytest_configure(config: pytest.Config) -> None:
    # One thread per process: in-process references and the ranks share 2 cores.
    torch.set_num_threads(1)
    if f"not {PROCESSES}" in (config.option.markexpr or ""):
        _refuse_unmarked_process_starts()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    _RUNNING["item"] = item


def _refuse_unmarked_process_starts() -> None:
    """The fast tier (``-m "not processes"``) starts no process: a test that starts one (``subprocess`` or
    ``multiprocessing``, in its body or its fixtures) without the marker fails, naming itself, so the marker never
    goes stale."""
    import multiprocessing.process
    import subprocess

    def check(what: str) -> None:
        item = _RUNNING["item"]
        if item is not None and item.get_closest_marker(PROCESSES) is None:
            raise RuntimeError(f"{item.nodeid} starts {what} but is not marked @pytest.mark.{PROCESSES}: the fast "
                               f"tier (-m 'not {PROCESSES}') starts no process; mark the test (or its module)")

    popen_init, process_start = subprocess.Popen.__init__, multiprocessing.process.BaseProcess.start

    def guarded_popen_init(self, *args, **kwargs):
        check(f"a process ({args[0] if args else kwargs.get('args')!r})")
        popen_init(self, *args, **kwargs)

    def guarded_start(self):
        check("a multiprocessing process")
        process_start(self)

    subprocess.Popen.__init__ = guarded_popen_init
    multiprocessing.process.BaseProcess.start = guarded_start


@pytest.fixture
def ptb() -> Path:
    """The PTB directory (fails, never skips, when the files are missing)."""
    return ptb_dir()


@pytest.fixture(autouse=True, scope="session")
def _token_cache_of_the_session(tmp_path_factory: pytest.TempPathFactory):
    """File corpora opened without a ``cache_dir`` tokenize into a directory of this session, not into
    ``~/.cache/lightning_mp_lstm`` (commands run as processes still use their config's ``data.cache_dir``)."""
    from lightning_mp_lstm.data import token_store

    default = token_store.DEFAULT_CACHE_DIR
    token_store.DEFAULT_CACHE_DIR = str(tmp_path_factory.mktemp("token_cache"))
    yield
    token_store.DEFAULT_CACHE_DIR = default


@pytest.fixture
def compose_train(tmp_path: Path) -> Callable[..., DictConfig]:
    """Compose ``conf/train.yaml`` with overrides, the run directory (``paths.output_dir``) this test's ``tmp_path``."""

    def _compose(*overrides: str) -> DictConfig:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            return compose(config_name="train", overrides=[f"paths.output_dir={tmp_path}", *overrides])

    return _compose


#: Tests that left an in-process launch behind (cleaned up after them; listed at the end of the run).
_LEFT_BEHIND: list[str] = []


@pytest.fixture(autouse=True)
def _no_launched_job_left_behind(request: pytest.FixtureRequest):
    """Clean up after a test that leaves an in-process launch behind (a one-process ``mp_lstm`` Trainer fitted
    without ``strategy.shutdown()``): the default process group, and ``MASTER_ADDR``/``MASTER_PORT``/
    ``LOCAL_RANK``/... in the environment, which every later ``python train.py`` subprocess would inherit (it then
    binds the stale port, EADDRINUSE, or takes itself for an externally launched rank). The test is named at the
    end of the run."""
    import os

    import torch.distributed as dist
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    from lightning_mp_lstm.strategy.launcher import LAUNCH_ENV

    before = {key: os.environ.get(key) for key in LAUNCH_ENV}
    threads, rank = torch.get_num_threads(), rank_zero_only.rank
    yield
    changed = [key for key in LAUNCH_ENV if os.environ.get(key) != before[key]]
    group = dist.is_available() and dist.is_initialized()
    if group:
        dist.destroy_process_group()
    for key in changed:
        if before[key] is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = before[key]
    torch.set_num_threads(threads)
    rank_zero_only.rank = rank
    if group or changed:
        _LEFT_BEHIND.append(f"{request.node.nodeid}: {'a process group, ' if group else ''}{', '.join(changed)}")


def pytest_terminal_summary(terminalreporter) -> None:
    if _LEFT_BEHIND:
        terminalreporter.section("tests that left an in-process launch behind (cleaned up)")
        for line in _LEFT_BEHIND:
            terminalreporter.write_line(f"{line}: call strategy.shutdown() after an in-process fit")


@pytest.fixture
def one_process_group(monkeypatch):
    """A default process group of this process alone (gloo; NCCL too where CUDA is), destroyed afterwards."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, rank=0, world_size=1, store=dist.HashStore())
    yield
    dist.destroy_process_group()

"""What a training token costs in activations, counted without allocating anything, and the memory a process may use.

An LSTM keeps every time step's activations for backpropagation through time: a batch's activations grow with
rows x length. :func:`activation_bytes_per_token` counts what each block's forward (and the loss, for the last block)
saves for the backward pass, on a copy of the block whose parameters are torch's fake tensors
(``FakeTensorMode``): shapes only, and no block, of this process or another, is ever allocated. Fake tensors do not
know the workspace the host's fused LSTM kernel keeps (about 17 floats per hidden unit and token, where they see 3),
so an LSTM layer's kernel is measured for real on a copy a fraction as wide (its workspace grows with the widths)
and scaled up. A block that cannot run on fake tensors (a module's own method reading real parameters) is estimated
from its widths instead. :func:`memory_per_process` says what a process may use.
"""

from __future__ import annotations

import functools
import os
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_mp_lstm.models.blocks import run_lstm_layer
from lightning_mp_lstm.models.contract import PipelineModel

__all__ = ["GIB", "HOST", "activation_bytes_per_token", "memory_per_process"]

GIB = 2**30
_PROBE_ROWS, _PROBE_LENGTHS = 2, (8, 16)  # two lengths: what does not grow with the tokens (weights) cancels out
_FLOAT = 4
_KERNEL_WIDTH = 32  # the widest LSTM layer measured for real (a few kB of weights)
#: Where probes run: byte counts do not depend on the device, and no GPU is touched before launch.
HOST = torch.device("cpu")


class _Saved:
    """Counts the bytes of what autograd saves for backward, each storage once (an LSTM's weights are saved once; a
    view of them is not another copy)."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        self.storages[storage._cdata] = storage.nbytes()
        return tensor

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor)

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def _per_token(count: Any) -> float:
    """``count(length)`` 's growth per token between the two probe lengths (what does not grow cancels out)."""
    short, long = _PROBE_LENGTHS
    return max(0.0, (count(long) - count(short)) / (_PROBE_ROWS * (long - short)))


def _block_bytes(blocks: PipelineModel, name: str, last: bool, length: int) -> int:
    """Bytes the forward pass (and the loss, for the last block) of a fake copy of block ``name`` saves."""
    host = HOST
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    saved = _Saved()
    block = blocks.probe_block(name, mode, host)
    block.train()
    with mode, saved.hooks():
        inputs = blocks.example_input(name, _PROBE_ROWS, length, host)
        outputs = block(inputs)
        if last:
            blocks.microbatch_loss(outputs, blocks.example_targets(_PROBE_ROWS, length, host), block=block)
    return saved.total


def _kernel_bytes(width: int, hidden: int, length: int, fake: bool, scale: int = 1) -> int:
    """Bytes one LSTM layer of ``width`` inputs and ``hidden`` units saves over a probe batch, from fake tensors or,
    ``scale`` times narrower, for real on the host."""
    mode = FakeTensorMode() if fake else nullcontext()
    width, hidden = max(1, round(width / scale)), max(1, round(hidden / scale))
    saved = _Saved()
    with mode, torch.random.fork_rng(devices=[]):
        shapes = [(4 * hidden, width), (4 * hidden, hidden), (4 * hidden,), (4 * hidden,)]
        weights = [torch.randn(shape, device=HOST, requires_grad=True) for shape in shapes]
        x = torch.randn(_PROBE_ROWS, length, width, device=HOST, requires_grad=True)
        with saved.hooks():
            run_lstm_layer(weights, x, None, True)
    return saved.total * scale


@functools.cache
def _kernel_workspace(width: int, hidden: int) -> float:
    """Bytes per token the host's LSTM kernel keeps beyond what fake tensors show, measured on a layer at most
    :data:`_KERNEL_WIDTH` and at most half as wide, and scaled back."""
    # Never the block's own shape (at least half as wide): a probe is not a copy of any process's block.
    scale = max(2, -(-max(width, hidden) // _KERNEL_WIDTH))
    real = _per_token(lambda length: _kernel_bytes(width, hidden, length, fake=False, scale=scale))
    return max(0.0, real - _per_token(lambda length: _kernel_bytes(width, hidden, length, fake=True)))


def _estimate(blocks: Any, name: str) -> float:
    """Bytes per token from the widths alone (a block that cannot run on fake tensors): its input, its output and a
    dropout mask; an LSTM layer its four gates, cell and hidden states too."""
    names = list(blocks.block_names)
    index = names.index(name)
    sizes = getattr(blocks, "sizes", None)
    if 0 < index < len(names) - 1 and sizes:
        width, hidden = sizes[index - 1]
        return _FLOAT * (width + 8 * hidden)
    width = getattr(blocks, "embedding_dim", 0) if index == 0 else getattr(blocks, "decoder_in", 0)
    return _FLOAT * 3 * width


def activation_bytes_per_token(blocks: PipelineModel) -> dict[str, float]:
    """Bytes each block keeps for the backward pass per token of a training batch (float32, the host's kernels).

    A decoder whose loss decodes slices of tokens keeps only its inputs per token; the slice's logits are the loss's
    working set (:mod:`~lightning_mp_lstm.planning.memory`). Models without ``probe_block`` are estimated from their
    widths when they have them, else counted as nothing.
    """
    names = list(blocks.block_names)
    sizes = getattr(blocks, "sizes", None) or []
    result = {}
    for index, name in enumerate(names):
        last = name == names[-1]
        if last and getattr(blocks, "decodes_in_loss", False):
            result[name] = float(_FLOAT * getattr(blocks, "decoder_in", 0))
            continue
        try:
            result[name] = _per_token(lambda length, name=name, last=last: _block_bytes(blocks, name, last, length))
        except Exception:  # noqa: BLE001  (a module's code that fake tensors cannot run: estimated from its widths)
            result[name] = _estimate(blocks, name)
            continue
        if 0 < index < len(names) - 1 and len(sizes) == len(names) - 2:
            result[name] += _kernel_workspace(*sizes[index - 1])
    return result


def _cgroup_limit() -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1 ``memory.limit_in_bytes``), if any."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 2**60:
            return int(text)
    return None


def memory_per_process(device: torch.device, local_processes: int) -> int | None:
    """The memory one process may use: on a GPU its memory; on the CPU the machine's (or its cgroup's limit)
    shared by the ``local_processes`` of this node; ``None`` where it cannot be told."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    if device.type != "cpu":
        return None
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
    limit = _cgroup_limit()
    return (min(total, limit) if limit else total) // max(1, local_processes)

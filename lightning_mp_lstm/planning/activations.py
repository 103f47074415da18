"""Whether the activations of the largest training batch can fit the memory a process may use: checked before
launch, so that a corpus with one enormous line fails at once, naming the line, instead of growing until the
kernel kills a rank.

An LSTM keeps every time step's activations for backpropagation through time: a batch's activations grow with
rows x bucket length, and the largest bucket is as long as the longest line (``buckets=auto`` splits lines far
longer than the rest; ``max_bucket_length`` sets the cap). :func:`activation_bytes_per_token` measures what each
block saves for backward per token, on a few tokens on the host; :func:`check_activation_memory` puts that against
:func:`memory_per_process`.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch

from lightning_mp_lstm.models.contract import PipelineModel
from lightning_mp_lstm.planning.layout import ParallelLayout

__all__ = ["ActivationMemoryError", "activation_bytes_per_token", "check_activation_memory", "memory_per_process"]

GIB = 2**30
_PROBE_ROWS, _PROBE_LENGTHS = 2, (8, 16)  # two lengths: what does not grow with the tokens (weights) cancels out


class ActivationMemoryError(ValueError):
    """A training batch whose activations cannot fit the memory a process may use."""


def _saved_bytes(blocks: PipelineModel, name: str, last: bool, length: int) -> int:
    """Bytes the forward pass (and the loss, for the last block) of block ``name`` saves for backward."""
    # On the host: byte counts do not depend on the device, and no GPU is touched before launch (the meta device
    # would do, but autocast, which blocks may switch off, refuses it).
    host = torch.device("cpu")
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    block = blocks.build_block(name, host)
    inputs = blocks.example_input(name, _PROBE_ROWS, length, host)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        outputs = block(inputs)
        if last:
            blocks.microbatch_loss(outputs, blocks.example_targets(_PROBE_ROWS, length, host))
    return total


def activation_bytes_per_token(blocks: PipelineModel) -> dict[str, float]:
    """Bytes each block saves for backward per token of a training batch (measured in float32 on the host)."""
    names = list(blocks.block_names)
    short, long = _PROBE_LENGTHS
    return {name: (_saved_bytes(blocks, name, name == names[-1], long) - _saved_bytes(blocks, name, name == names[-1],
                                                                                      short))
            / (_PROBE_ROWS * (long - short)) for name in names}


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


def check_activation_memory(blocks: PipelineModel, layout: ParallelLayout, datamodule: Any, budget: int | None,
                            why: str) -> None:
    """Refuse a run whose largest training batch needs more activation memory on some process than ``budget``.

    The estimate is a lower bound for any partition and schedule: a process holds at least the most demanding block,
    or its share of them all, for the microbatches a schedule keeps in flight before its first backward
    (``min(n_microbatches, pipeline stages)``), at the longest bucket.

    Args:
        blocks: the model's pipeline view.
        layout: the resolved layout.
        datamodule: gives ``bucket_lengths`` and ``batch_size`` or ``max_tokens`` (otherwise nothing is checked), and
            optionally ``longest_sentence()``: the longest training line's length and where it is.
        budget: bytes one process may use (``None``: not checked).
        why: where ``budget`` comes from, for the message.

    Raises:
        ActivationMemoryError: naming the batch, its longest line, the estimate, the budget and the options to change.
    """
    lengths = getattr(datamodule, "bucket_lengths", None)
    rows, tokens = getattr(datamodule, "batch_size", None), getattr(datamodule, "max_tokens", None)
    if budget is None or not lengths or not (rows or tokens):
        return
    longest = max(lengths)
    if tokens:
        rows = min(rows or tokens, max(1, tokens // longest))
    replica_rows = max(1, math.ceil(rows / layout.data_parallel_size))
    m = max(1, layout.n_microbatches)
    in_flight = math.ceil(replica_rows / m) * min(m, layout.pipeline_parallel_size)
    try:
        per_token = activation_bytes_per_token(blocks)
    except Exception:  # noqa: BLE001  (a model whose blocks cannot run on the host: the check is a safeguard only)
        return
    share = max(max(per_token.values()), sum(per_token.values()) / layout.pipeline_parallel_size)
    need = share / layout.tensor_parallel_size * in_flight * longest
    if need <= budget:
        return
    where = ""
    describe = getattr(datamodule, "longest_sentence", None)
    if callable(describe):
        length, place = describe()
        if length >= longest:
            where = f", as long as the longest training line ({place}, {length:,} tokens)"
    raise ActivationMemoryError(
        f"a training batch of the longest bucket ({longest:,} tokens{where}) keeps about {need / GIB:,.1f} GiB of "
        f"activations on a process ({in_flight} sentences in flight), more than the {budget / GIB:,.1f} GiB each may "
        f"use ({why}). Cap the bucket length (train.py: buckets.max_length=<tokens>; LMDataModule(max_bucket_length="
        "...)): longer lines are then split into pieces; or lower data.batch_size / data.max_tokens"
    )

"""Layout-independent checkpoints: parameters and optimizer state keyed by parameter name.

Every process holds only its own blocks. A checkpoint holds the full model's parameter names, so one written by
any layout loads into any other (one process included); on load each process takes the entries of its own
parameters. Checkpoints written by Lightning's one-process strategies (optimizer state keyed by position) load too.

One module per job:

- :mod:`~lightning_mp_lstm.checkpoint.files`: one file, written atomically (:class:`AtomicCheckpointIO`) and read
  with a clear error for a damaged file (:func:`read_checkpoint`, :class:`CheckpointError`).
- :mod:`~lightning_mp_lstm.checkpoint.integrity`: the CRC-32 checksums a checkpoint records when it is written (of
  every tensor of a file, of every block of a sharded directory) and the comparison when it is read.
- :mod:`~lightning_mp_lstm.checkpoint.state`: model and optimizer state by parameter name, on torch's
  ``torch.distributed.checkpoint.state_dict`` API, for a model pruned to a process's blocks (tied weights,
  positional states, strict checks: :func:`local_model_state`).
- :mod:`~lightning_mp_lstm.checkpoint.sharded`: the sharded format, a directory in which every rank writes its own
  tensors with ``torch.distributed.checkpoint`` (:func:`save_sharded`, :func:`load_sharded`, :func:`read_sharded`);
  :func:`consolidate` turns it into one ordinary file.
- :mod:`~lightning_mp_lstm.checkpoint.formats`: :class:`FileFormat` (one file gathered on global rank 0,
  :func:`gather_to_rank_zero`) and :class:`ShardedFormat`, the objects ``MPLSTMStrategy``'s checkpoint hooks
  delegate to.
- :mod:`~lightning_mp_lstm.checkpoint.callback`: :class:`RunCheckpoint`, ``train.py``'s ``ModelCheckpoint``, whose
  step checkpoints do not wait for a validation metric.
"""

# AtomicCheckpointIO calls _serialize from here: tests replace lightning_mp_lstm.checkpoint._serialize to fail a write
from lightning_mp_lstm.checkpoint.callback import RunCheckpoint
from lightning_mp_lstm.checkpoint.files import AtomicCheckpointIO, CheckpointError, read_checkpoint
from lightning_mp_lstm.checkpoint.files import _serialize as _serialize
from lightning_mp_lstm.checkpoint.formats import (
    CheckpointFormat,
    FileFormat,
    ShardedFormat,
    checkpoint_format,
    gather_to_rank_zero,
)
from lightning_mp_lstm.checkpoint.sharded import (
    SHARDED_METADATA,
    consolidate,
    is_sharded,
    load_sharded,
    read_sharded,
    save_sharded,
)
from lightning_mp_lstm.checkpoint.state import (
    ModelNames,
    load_model_state,
    load_optimizer_state,
    local_model_state,
    merge_optimizer_states,
    model_state,
    name_keyed_optimizer_state,
    optimizer_state,
    with_aliases,
)

__all__ = [
    "SHARDED_METADATA",
    "AtomicCheckpointIO",
    "CheckpointError",
    "CheckpointFormat",
    "FileFormat",
    "ModelNames",
    "RunCheckpoint",
    "ShardedFormat",
    "checkpoint_format",
    "consolidate",
    "gather_to_rank_zero",
    "is_sharded",
    "load_model_state",
    "load_optimizer_state",
    "load_sharded",
    "local_model_state",
    "merge_optimizer_states",
    "model_state",
    "name_keyed_optimizer_state",
    "optimizer_state",
    "read_checkpoint",
    "read_sharded",
    "save_sharded",
    "with_aliases",
]

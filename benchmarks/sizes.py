"""How big and how long every section of ``benchmarks/run.py`` runs (:data:`FULL`, :data:`QUICK`), and the layouts
the ``layouts`` section compares.

A model size is a dictionary of ``LSTMLanguageModel``'s own keyword arguments (``vocab_size``, ``embedding_dim``,
``hidden_size``, ``num_layers``), as are ``benchmarks/overhead.py``'s :class:`Setup` fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: The bucket lengths of the MXNet example (``buckets=mxnet``).
MXNET_BUCKETS = [8, 16, 24, 32, 60]
#: ``conf/trainer/default.yaml``'s ``gradient_clip_val``: the clipping all-reduce is part of a real step.
CLIP = 0.25


def strategy_options(dp: int = 1, pp: int = 1, threads: int = 1, **options: Any) -> dict[str, Any]:
    """``MPLSTMStrategy`` keyword arguments of a layout.

    Args:
        dp: data-parallel replicas.
        pp: pipeline stages.
        threads: CPU threads per process.
        **options: further strategy options (schedule, partition, ...).

    Returns:
        The keyword arguments.
    """
    return {"data_parallel_size": dp, "pipeline_parallel_size": pp, "num_threads": threads, **options}


#: The layouts section's layouts: name -> (processes, strategy options).
LAYOUTS: dict[str, tuple[int, dict[str, Any]]] = {
    "1 process": (1, strategy_options(threads=2)),
    "dp2": (2, strategy_options(dp=2)),
    "pp2 even": (2, strategy_options(pp=2, partition="even")),
    "pp2 balanced": (2, strategy_options(pp=2, partition="balanced")),
    "pp2 balanced, m=auto": (2, strategy_options(pp=2, partition="balanced", n_microbatches="auto")),
    "pp4 balanced": (4, strategy_options(pp=4, partition="balanced")),
}


def _model(vocab_size: int, embedding_dim: int, hidden_size: int, num_layers: int) -> dict[str, int]:
    return {"vocab_size": vocab_size, "embedding_dim": embedding_dim, "hidden_size": hidden_size,
            "num_layers": num_layers}


@dataclass(frozen=True)
class Sizes:
    """How big and how long every section runs; the fields are grouped by section (prefix)."""

    # pipeline vs its bound: an LSTM model on fixed-shape random batches
    bound_model: dict[str, int] = field(default_factory=lambda: _model(2000, 256, 256, 4))
    bound_rows: int = 64
    bound_length: int = 35
    bound_m: tuple[int, ...] = (4, 8, 16)
    bound_warmup: int = 3
    bound_steps: int = 10
    # layouts on PTB: conf/model names -> overrides
    layout_models: dict[str, dict[str, Any]] = field(default_factory=lambda: {"tiny": {}, "small": {},
                                                                               "mxnet_ptb": {}})
    layout_batch: int = 64
    layout_warmup: int = 3
    layout_steps: int = 10
    layout_rounds: int = 3
    # partition regret: every contiguous 2-stage split of a model with a few blocks
    regret_model: dict[str, int] = field(default_factory=lambda: _model(10000, 256, 256, 4))
    regret_rows: int = 64
    regret_length: int = 35
    regret_m: int = 4
    regret_warmup: int = 2
    regret_steps: int = 6
    regret_rounds: int = 2
    # bucketing: one process on PTB
    bucket_model: str = "small"
    bucket_overrides: dict[str, Any] = field(default_factory=dict)
    bucket_warmup: int = 3
    bucket_steps: int = 20
    bucket_auto: tuple[int, ...] = (5, 10)
    # layout advice: the most microbatches a pipeline candidate may have
    advice_max_microbatches: int = 32
    # wavefront: time chunks against row microbatches, one model and global batch (mxnet_ptb's 8 layers and
    # embedding at half its hidden size, a 2,000-word vocabulary: a step of about a second on 2 cores), fixed-shape
    # random batches; per pipeline depth: GPipe's m, the wavefront's k, (m, k) pairs
    wave_model: dict[str, int] = field(default_factory=lambda: _model(2000, 200, 200, 8))
    wave_rows: int = 32
    wave_length: int = 35
    wave_runs: dict[int, dict[str, tuple]] = field(default_factory=lambda: {
        2: {"m": (2, 4), "k": (2, 4, 8), "mk": ((2, 2),)},
        4: {"m": (4, 8), "k": (4, 8), "mk": ()}})  # 4 single-thread processes on 2 cores: oversubscribed
    wave_picture_k: int = 4
    #: each run in fresh processes (its peak memory its own); otherwise with the other sections' jobs
    wave_fresh: bool = True
    wave_warmup: int = 2
    wave_steps: int = 6
    # memory (benchmarks/memory.py)
    memory_hidden: int = 1024
    memory_rows: int = 8
    memory_steps: int = 2
    memory_layouts: dict[str, int] = field(default_factory=lambda: {"1 process": 1, "pp2": 2, "pp4": 4})
    memory_formats: tuple[str, ...] = ("file", "sharded")
    #: measure memory as the first job of the other sections' processes (one-file save only) instead of in
    #: processes of its own
    memory_inline: bool = False
    # strategy overhead: benchmarks/overhead.py's Setup fields (the model, global batch and microbatches of the
    # measurement behind its issue: batch 32 x 35, m = 4), its layouts and schedules
    overhead: dict[str, Any] = field(default_factory=lambda: {"rows": 32, "microbatches": 4})
    overhead_layouts: tuple[str, ...] = ("pp2", "dp2_pp2")
    overhead_schedules: tuple[str, ...] = ("GPipe", "1F1B")
    overhead_steps: int = 30
    overhead_warmup: int = 5
    overhead_rounds: int = 5
    # seconds each group of processes may take
    timeout: float = 1800.0
    #: how the ranks start (lightning_mp_lstm.base.testing.run_ranks): "spawn" as launched ranks do, or "forkserver"
    #: (torch and Lightning imported once; QUICK, where only the schema and the flow are checked)
    start_method: str = "spawn"


FULL = Sizes()
_TINY = {"embedding_dim": 16, "hidden_size": 16}
QUICK = Sizes(
    bound_model=_model(64, 16, 16, 2), bound_rows=16, bound_length=8, bound_warmup=1, bound_steps=3,
    layout_models={"tiny": _TINY, "small": _TINY, "mxnet_ptb": _TINY}, layout_batch=64, layout_warmup=1,
    layout_steps=3, layout_rounds=1,
    regret_model=_model(64, 16, 16, 2), regret_rows=16, regret_length=8, regret_m=2, regret_warmup=1,
    regret_steps=2, regret_rounds=1,
    bucket_overrides=_TINY, bucket_warmup=1, bucket_steps=3, advice_max_microbatches=4,
    memory_hidden=32, memory_rows=4, memory_steps=1, memory_layouts={"1 process": 1, "pp2": 2},
    memory_formats=("file",), memory_inline=True,
    overhead={**_model(64, 16, 16, 2), "rows": 16, "length": 8, "microbatches": 4},
    overhead_steps=4, overhead_warmup=1, overhead_rounds=1, overhead_layouts=("pp2",), overhead_schedules=("1F1B",),
    wave_model=_model(64, 16, 16, 2), wave_rows=16, wave_length=8,
    wave_runs={2: {"m": (2,), "k": (2,), "mk": ((2, 2),)}},
    wave_picture_k=2, wave_warmup=1, wave_steps=2, wave_fresh=False,
    timeout=300.0, start_method="forkserver",
)

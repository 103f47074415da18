"""Python's garbage collector while the steps run: what was built before them is left out of its passes.

A full collection walks every object the process holds: after torch, Lightning and Hydra are imported and a model is
built, a few hundred thousand of them. On the 2-core box such a pass took 190-220 ms, and the main job's step 26 took
242 ms where its neighbours took 19 (``python benchmarks/main_job.py``: the slowest step 10.8x its shape's median).
:func:`leave_out_built_objects` collects once and moves everything alive to the permanent generation (``gc.freeze``),
so that later passes walk only what the steps create. :func:`take_back_built_objects` undoes it when the strategy is
torn down, so that what a finished run drops can be collected again. (torchtitan meets the same pauses by turning
automatic collection off and collecting every N steps; freezing keeps automatic collection for the steps' objects.)
"""

from __future__ import annotations

import gc

__all__ = ["leave_out_built_objects", "take_back_built_objects"]


def leave_out_built_objects() -> None:
    """Collect what is garbage now, then leave every object still alive out of the collector's later passes."""
    gc.collect()
    gc.freeze()


def take_back_built_objects() -> None:
    """Put the objects :func:`leave_out_built_objects` left out back under the collector."""
    gc.unfreeze()

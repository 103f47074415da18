"""A picture of one recorded step (matplotlib, imported only when a picture is drawn)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_mp_lstm.timeline.record import COMPUTE, StepRecord, predicted_bubble

__all__ = ["COLOURS", "draw"]

#: The colour of each span kind.
COLOURS = {"forward": "#4c72b0", "loss": "#64b5cd", "backward": "#dd8452", "backward_input": "#c44e52",
           "backward_weight": "#937860", "compute": "#8172b3", "send": "#55a868", "recv": "#8c8c8c"}


def draw(record: StepRecord, path: str | Path) -> Any:
    """A picture of one step: one row per stage of every rank that ran it (with data parallelism each replica
    gets its own rows), time across; forward, backward and communication in their colours, microbatch numbers
    on the spans, idle time left blank.

    Args:
        record: the step.
        path: where to save the PNG.

    Returns:
        The (closed) matplotlib figure.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    # Replica by replica (a rank's offset from its stage's rank in replica 0 tells the replica), stages in order.
    pairs = sorted({(span.stage, span.rank) for span in record.spans} or {(0, 0)},
                   key=lambda p: (p[1] - record.stage_ranks.get(p[0], p[1]), p[0]))
    row_of = {pair: i for i, pair in enumerate(pairs)}
    rows = len(pairs)
    figure, axes = plt.subplots(figsize=(12, 1.0 + 0.7 * rows), dpi=100)
    for span in record.spans:
        compute = span.kind in COMPUTE
        row = row_of[(span.stage, span.rank)]
        height, bottom = (0.6, row - 0.3) if compute else (0.18, row + 0.32)
        start, width = span.start * 1e3, (span.end - span.start) * 1e3
        axes.broken_barh([(start, width)], (bottom, height), facecolors=COLOURS[span.kind], edgecolor="white",
                         linewidth=0.3)
        if compute and width > record.wall * 1e3 / 80:
            axes.text(start + width / 2, row, str(span.microbatch), ha="center", va="center", fontsize=7,
                      color="white")
    axes.set_yticks(range(rows))
    axes.set_yticklabels([f"stage {stage} (rank {rank})" for stage, rank in pairs])
    axes.set_ylim(rows - 0.5, -0.5)
    axes.set_xlim(0, record.wall * 1e3)
    axes.set_xlabel("milliseconds since the step started")
    ranks = len(set(record.stage_ranks.values())) or 1
    predicted = predicted_bubble(record.schedule, ranks, max(1, record.num_stages // ranks), record.n_microbatches)
    pieces = "units (rows x time chunks)" if record.schedule == "Wavefront" else "microbatches"
    axes.set_title(f"step {record.step}: {record.schedule}, {record.n_microbatches} {pieces}, "
                   f"{record.wall * 1e3:.1f} ms; bubble measured {record.bubble():.1%} (in the schedule "
                   f"{record.schedule_bubble():.1%}), predicted {predicted:.1%}")
    if record.schedule_end < record.wall:
        axes.axvline(record.schedule_end * 1e3, color="grey", linestyle=":", linewidth=0.8)
    kinds = sorted({span.kind for span in record.spans}, key=list(COLOURS).index)
    axes.legend(handles=[Patch(color=COLOURS[k], label=k) for k in kinds], loc="upper right", fontsize=7,
                ncol=len(kinds))
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
    return figure

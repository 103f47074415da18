"""The pipeline's sum of the clip's squared gradient norm through receives posted before the schedule (gloo).

The first stages end their backward last under 1F1B and GPipe, so an all-reduce of the norm after the schedule holds
them for a round trip with ranks that wait already (1.7 ms a step measured on rank 0 of the main job). Posted before
the schedule, the peers' values are there when a rank reaches its clip (a receive posted before the send arrives:
0.04 ms against 0.45 ms for one posted after, two CPU processes). Only where the transport matches messages by tag
(:mod:`~lightning_mp_lstm.pipeline.transport`: gloo); elsewhere (NCCL) the clip keeps its all-reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from lightning_mp_lstm.pipeline.transport import posts_receives_ahead

__all__ = ["NormExchange"]


class NormExchange:
    """The receives of the other pipeline ranks' squared norms for this process's next clip.

    Args:
        group: the pipeline's process group.
        device: where the norms are (the process's device).
        tag: the tag of the norms' messages, apart from every other message between the pipeline's ranks.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, tag: int) -> None:
        self.group, self.device, self.tag = group, device, tag
        self._receives: dict[int, tuple[torch.Tensor, Any]] | None = None
        self._sends: list[Any] = []
        self._answered: list[Any] = []  # receives cancel() answered, kept until they complete

    @property
    def posted(self) -> bool:
        """Whether receives are posted for the next clip."""
        return self._receives is not None

    def expect(self) -> None:
        """Post the receives of the next clip (once; nothing on NCCL or in a pipeline of one rank)."""
        if (self._receives is not None or dist.get_world_size(self.group) == 1
                or not posts_receives_ahead(self.group)):
            return
        me = dist.get_rank(self.group)
        self._receives = {}
        for peer in range(dist.get_world_size(self.group)):
            if peer != me:
                buffer = torch.empty((), dtype=torch.float32, device=self.device)
                self._receives[peer] = buffer, dist.irecv(buffer, group=self.group, group_src=peer, tag=self.tag)

    def take(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The pipeline's sum of a squared norm through the posted receives (``None``: none posted, all-reduce).

        This process's value goes to every peer (its owner waits for the sends: :meth:`take_sends`), and every rank
        adds the pipeline's values in rank order, so each computes the same bits and scales by the same coefficient.
        """
        receives, self._receives = self._receives, None
        if receives is None:
            return None

        def total(squared: torch.Tensor) -> torch.Tensor:
            self._sends += [dist.isend(squared, group=self.group, group_dst=peer, tag=self.tag) for peer in receives]
            for _, work in receives.values():
                work.wait()
            me = dist.get_rank(self.group)
            values = [squared if peer == me else receives[peer][0] for peer in range(dist.get_world_size(self.group))]
            result = values[0]
            for value in values[1:]:
                result = result + value
            return result

        return total

    def cancel(self) -> None:
        """Answer the posted receives when the step ended without its clip (an error raised on every rank): every
        rank sends each peer NaN, which no clip reads, so no posted receive is left to take a later clip's norm (a
        clip that took it, a peer that went on alone, scales by NaN, never by a plausible norm). The receives'
        handles are kept until they complete (gloo loses the message of a receive dropped while posted); nothing
        is waited for here."""
        receives, self._receives = self._receives, None
        if receives:
            nothing = torch.full((), float("nan"), dtype=torch.float32, device=self.device)
            self._sends += [dist.isend(nothing, group=self.group, group_dst=peer, tag=self.tag) for peer in receives]
            self._answered += [work for _, work in receives.values()]

    def take_sends(self) -> list[Any]:
        """The sends since the last call, for the caller to wait for (the peers' receives were posted); answered
        receives that completed are forgotten."""
        sends, self._sends = self._sends, []
        self._answered = [work for work in self._answered if not work.is_completed()]
        return sends

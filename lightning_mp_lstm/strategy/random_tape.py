"""Equal randomness for a module's own step and its pipeline: record every random draw once, replay it in pieces.

:class:`RandomTape` is a ``TorchFunctionMode``. Recording, it lets the module's own ``training_step`` draw (dropout
masks, ``bernoulli_``, ``rand`` ...) and keeps each draw under the block the step was in when it drew: the
embedding until the first LSTM layer is called, then each LSTM layer until the next one (what the module does to a
layer's output belongs to that layer), then the decoder. Replaying, the pipeline's stages draw nothing: each block's
forward takes the draws its block made on the whole batch, in the same order, cut to the rows of the microbatch it
runs (and to the time steps of its time chunk), so a dropout the pipeline runs sees exactly the mask the module's own
step used. A draw the pipeline makes that the module did not, or one it never makes, is noted: that is a random part
one side does not reproduce. ``F.dropout`` is replayed as its Bernoulli mask; the dropout inside a multi-layer
``nn.LSTM``'s kernel cannot be seen (it is run at rate 0 when verifying).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

__all__ = ["Draw", "RandomTape"]

_DROPOUTS = {F.dropout}
_IN_PLACE = {torch.Tensor.bernoulli_, torch.Tensor.uniform_, torch.Tensor.normal_, torch.Tensor.random_,
             torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.cauchy_, torch.Tensor.log_normal_}
_OUT_OF_PLACE = {torch.bernoulli, torch.Tensor.bernoulli, torch.rand, torch.rand_like, torch.randn, torch.randn_like,
                 torch.randint, torch.randint_like, torch.randperm, torch.normal, torch.poisson, torch.multinomial}


@dataclass(frozen=True)
class Draw:
    """One random tensor the module's step drew: in which block, its values."""

    block: str
    values: torch.Tensor


class RandomTape(TorchFunctionMode):
    """Records the random draws of a module's step by block, or replays them into the pipeline's pieces.

    Args:
        rows: the rows of the batch the draws are made on; ``length``: its time steps.
        time_first: the module's activations are ``(T, B, ...)`` (which axis of a draw is time when both sizes agree).

    Attributes:
        draws: what the module's step drew, in order.
        piece: while replaying, ``() -> (first row, rows, first time step, time steps)`` of the piece running now.
        mismatches: what the two sides did not draw alike, for the report.
    """

    def __init__(self, rows: int, length: int, time_first: bool = False) -> None:
        super().__init__()
        self.rows, self.length, self.time_first = rows, length, time_first
        self.draws: list[Draw] = []
        self.replaying = False
        self.piece: Callable[[], tuple[int, int, int, int]] | None = None
        self.mismatches: list[str] = []
        self._block: str | None = ""
        self._key: Any = None
        self._cursor: dict[tuple[str, Any], int] = defaultdict(int)
        self._ran: set[str] = set()

    # ----- where a draw belongs ---------------------------------------------------------------------------------
    def enter(self, block: str | None, key: Any = None) -> None:
        """The step (recording) or a pipeline block forward (replaying; ``key``: which piece) is now in ``block``
        (``None``: a forward that is no piece of the batch, which draws as it likes)."""
        self._block, self._key = block, key
        if self.replaying and block is not None:
            self._ran.add(block)

    def replay(self) -> RandomTape:
        """Switch from recording to replaying (the cursors start at every block's first draw)."""
        self.replaying, self._cursor, self._ran = True, defaultdict(int), set()
        return self

    def unused(self) -> dict[str, int]:
        """Per block that ran in the pipeline, how many of the module's draws some piece of it did not take."""
        recorded: dict[str, int] = defaultdict(int)
        for draw in self.draws:
            recorded[draw.block] += 1
        taken: dict[str, int] = {}
        for (block, _), count in self._cursor.items():
            taken[block] = min(taken.get(block, count), count)
        return {block: count - taken.get(block, 0) for block, count in recorded.items()
                if block in self._ran and count > taken.get(block, 0)}


    # ----- the mode ---------------------------------------------------------------------------------------------
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func in _DROPOUTS:
            x = args[0]
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if not training or p == 0:
                return func(*args, **kwargs)
            mask = self._draw(lambda: torch.empty_like(x).bernoulli_(1 - p), x.shape, x)
            return x * (mask.to(x.dtype) / (1 - p))
        if func in _IN_PLACE:
            target = args[0]
            values = self._draw(lambda: func(*args, **kwargs).clone(), target.shape, target)
            with torch.no_grad():
                target.copy_(values)
            return target
        if func in _OUT_OF_PLACE:
            return self._draw(lambda: func(*args, **kwargs), None, None)
        return func(*args, **kwargs)

    def _draw(self, make: Callable[[], torch.Tensor], shape: Any, like: torch.Tensor | None) -> torch.Tensor:
        if self._block is None:
            return make()
        if not self.replaying:
            values = make()
            self.draws.append(Draw(self._block, values.detach().clone()))
            return values
        key = (self._block, self._key)
        index = self._cursor[key]
        self._cursor[key] = index + 1
        recorded = [d for d in self.draws if d.block == self._block]
        made = make() if shape is None else torch.empty(shape, dtype=like.dtype, device=like.device)
        if index >= len(recorded):
            self.mismatches.append(f"block {self._block}: the pipeline draws a random tensor of shape "
                                   f"{tuple(made.shape)} that the module's own step does not (a dropout the "
                                   "declaration adds)")
            return make() if shape is not None else made
        cut = self._cut(recorded[index].values, made.shape)
        if cut is None:
            self.mismatches.append(f"block {self._block}: the module drew shape {tuple(recorded[index].values.shape)} "
                                   f"where the pipeline draws shape {tuple(made.shape)}")
            return make() if shape is not None else made
        return cut.to(device=made.device, dtype=made.dtype).clone()  # the record serves every piece: not theirs

    def _cut(self, values: torch.Tensor, shape: torch.Size) -> torch.Tensor | None:
        """The part of a whole-batch draw that the running piece of shape ``shape`` uses, or ``None``."""
        if tuple(values.shape) == tuple(shape):
            return values
        if values.dim() != len(shape) or self.piece is None:
            return None
        row, rows, start, steps = self.piece()
        differing = [d for d in range(values.dim()) if values.shape[d] != shape[d]]
        roles = []
        for d in differing:
            can_row = values.shape[d] == self.rows and shape[d] == rows
            can_time = values.shape[d] == self.length and shape[d] == steps
            roles.append("row" if can_row and not can_time else "time" if can_time and not can_row
                         else "either" if can_row else None)
        if None in roles:
            return None
        if roles.count("either"):  # equal sizes: the module's layout says which axis comes first
            first, second = ("time", "row") if self.time_first else ("row", "time")
            roles = [r if r != "either" else (first if i == 0 and len(roles) > 1 else
                                              second if len(roles) > 1 else "row") for i, r in enumerate(roles)]
        for d, role in zip(differing, roles):
            if role == "row":
                part = values.narrow(d, min(row, self.rows), max(0, min(rows, self.rows - row)))
                if part.shape[d] < rows:  # rows added to split the batch evenly: any values will do
                    pad = list(part.shape)
                    pad[d] = rows - part.shape[d]
                    part = torch.cat([part, part.new_zeros(pad)], dim=d)
                values = part
            else:
                values = values.narrow(d, start, steps)
        return values

"""Language-model batches as users have them, put rows first for the pipeline.

word_language_model and AWD-LSTM make time-first batches: ``(T, B)`` inputs with ``(T, B)`` or flat ``(T * B,)``
next-token targets. :func:`rows_first` accepts them when declared (``time_first=True``) and refuses, with the shapes
it saw and the fix, a batch that does not fit or whose next-token targets run along the other axis than the declared
one: read the other way, such batches would train a different model without any error.
"""

from __future__ import annotations

import torch

__all__ = ["check_time_axis", "rows_first"]


def rows_first(inputs: torch.Tensor, targets: torch.Tensor, time_first: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(inputs, targets)`` as ``(B, T)``.

    Raises:
        ValueError: inputs that are not 2-D, or targets that do not fit them (flat targets without
            ``time_first``: the message says to declare it).
    """
    if inputs.dim() != 2:
        raise ValueError(f"mp_lstm expects token ids of shape (B, T) (or (T, B) with time_first=True); got "
                         f"inputs of shape {tuple(inputs.shape)}")
    if targets.shape != inputs.shape:
        if targets.dim() != 1 or targets.numel() != inputs.numel():
            raise ValueError(f"targets of shape {tuple(targets.shape)} do not fit inputs of shape "
                             f"{tuple(inputs.shape)}: give one next-token target per input token")
        if not time_first:
            raise ValueError(
                f"flat targets of shape {tuple(targets.shape)} for inputs of shape {tuple(inputs.shape)}: that is "
                "how time-first batches ((T, B) inputs, targets.view(-1)) come, as word_language_model makes them; "
                "declare LSTMBlocks(..., time_first=True)")
        targets = targets.view(inputs.shape)
    if time_first:
        return inputs.t().contiguous(), targets.t().contiguous()
    return inputs, targets


def check_time_axis(inputs: torch.Tensor, targets: torch.Tensor, time_first: bool, ignore_index: int) -> None:
    """Refuse a batch (in its own layout) whose next-token targets run along the other axis than the declared time
    axis: there input ``t + 1`` equals target ``t`` for almost every real token, along the declared axis by chance.

    Raises:
        ValueError: naming the shapes seen, what they are, and the fix.
    """
    def agreement(axis: int) -> float:  # how often input t+1 is target t along ``axis``
        following = inputs.narrow(axis, 1, inputs.shape[axis] - 1)
        target = targets.narrow(axis, 0, targets.shape[axis] - 1)
        real = (following != ignore_index) & (target != ignore_index)
        return float((following == target)[real].float().mean()) if bool(real.any()) else 0.0

    declared, other = (0, 1) if time_first else (1, 0)
    if inputs.shape[other] > 1 and agreement(other) > 0.9 and agreement(declared) < 0.5:
        seen = (f"(T, B) = {inputs.shape[0]} steps of {inputs.shape[1]} sequences" if other == 0 else
                f"(B, T) = {inputs.shape[0]} sequences of {inputs.shape[1]} steps")
        fix = "declare LSTMBlocks(..., time_first=True)" if other == 0 else "remove time_first=True"
        raise ValueError(
            f"the batch's targets are the next tokens along dimension {other}, not along the declared time dimension "
            f"{declared}: inputs of shape {tuple(inputs.shape)} are {seen}; {fix} (read the other way, the batches "
            "would train a different model)")

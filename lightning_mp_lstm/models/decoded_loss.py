"""The decoder and the loss computed together, a slice of tokens at a time: a batch's logits never exist whole.

With a 267,735-word vocabulary (WikiText-103) the logits of 20 sentences of 200 tokens take 4.3 GB per copy, and the
cross-entropy keeps about three. Here the decoder runs inside the loss (:func:`decoded_cross_entropy`), over slices of
at most :func:`chunk_tokens` tokens whose logits take :data:`LOGITS_CHUNK_BYTES`; each slice is a
``torch.utils.checkpoint`` segment, so its logits are freed at once and computed again in the backward pass (the idea
behind Liger's fused linear cross-entropy and Apple's Cut Cross-Entropy, with torch's own checkpointing). A batch
that fits one slice runs exactly as an unsliced decoder and loss would, with nothing recomputed. The sum over slices
is today's summed cross-entropy up to float rounding (1e-6 relative, tested).

An ``nn.AdaptiveLogSoftmaxWithLoss`` decoder (Grave et al. 2017, how WikiText-103 LSTMs are trained) is a decoder and
a loss in one: it is called on the hidden states and the targets, and its log-probabilities of the targets are exact,
so its perplexity is. The same holds for predictions (:func:`decoded_predictions`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

__all__ = ["LOGITS_CHUNK_BYTES", "adaptive_clusters", "chunk_tokens", "decoded_cross_entropy", "decoded_predictions",
           "decoder_sizes", "is_adaptive", "logits_per_token", "token_cross_entropy"]

#: The most bytes one slice of float32 logits takes (what the loss holds at once is a few times this).
LOGITS_CHUNK_BYTES = 64 * 2**20
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def is_adaptive(decoder: nn.Module | None) -> bool:
    """Whether ``decoder`` is an adaptive softmax (called with the targets, no logits)."""
    return isinstance(decoder, nn.AdaptiveLogSoftmaxWithLoss)


def decoder_sizes(decoder: nn.Module) -> tuple[int, int]:
    """``(vocabulary, input width)`` of a decoder: an ``nn.Linear`` (its weight's shape; a tied decoder's
    ``in_features`` may be stale) or an adaptive softmax."""
    if is_adaptive(decoder):
        return int(decoder.n_classes), int(decoder.in_features)
    rows, width = decoder.weight.shape
    return int(rows), int(width)


def logits_per_token(decoder: nn.Module) -> float:
    """Logits the loss computes per token: the vocabulary (this process's columns of a vocabulary-parallel decoder),
    or an adaptive softmax's head plus each cluster's words times the share of tokens it holds, by Zipf's law over ids
    ordered by frequency (id ``k`` has probability about ``1 / (k + 1)``: a cluster of ids ``a .. b`` holds
    ``ln((b + 1) / (a + 1)) / ln(V + 1)`` of the tokens; WikiText-103: a head of 2,803 and 28,000 in the clusters)."""
    if is_adaptive(decoder):
        return decoder.head.weight.shape[0] + sum(share * size for share, size, _ in adaptive_clusters(decoder))
    weight = getattr(decoder, "weight", None)
    return float(weight.to_local().shape[0] if isinstance(weight, DTensor) else decoder_sizes(decoder)[0])


def adaptive_clusters(decoder: nn.AdaptiveLogSoftmaxWithLoss) -> list[tuple[float, int, int]]:
    """``(share of the tokens, words, projection width)`` of each cluster of an adaptive softmax, the shares by
    Zipf's law over ids ordered by frequency (:func:`logits_per_token`)."""
    bounds, total = decoder.cutoffs, math.log(decoder.n_classes + 1)
    return [(math.log((b + 1) / (a + 1)) / total, b - a, cluster[0].out_features)
            for (a, b), cluster in zip(zip(bounds, bounds[1:]), decoder.tail)]


def chunk_tokens(decoder: nn.Module, every_word: bool = False) -> int:
    """Tokens per slice: as many as keep one slice's logits within :data:`LOGITS_CHUNK_BYTES`
    (:func:`logits_per_token`; with ``every_word``, an adaptive softmax's whole vocabulary: predictions)."""
    columns = decoder_sizes(decoder)[0] if every_word and is_adaptive(decoder) else logits_per_token(decoder)
    return max(1, int(LOGITS_CHUNK_BYTES // (4 * columns)))


def token_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """Summed cross-entropy of (..., V) logits against (...) targets, leaving ``ignore_index`` out (in float32 for
    16-bit logits, else in the logits' own dtype: float64 stays float64). Vocabulary-sharded logits (a ``DTensor``
    from a column-wise parallel decoder) are computed on their shards by torch's ``loss_parallel``, which the caller
    enters around the forward and backward passes."""
    flat = logits.flatten(0, -2)
    flat = flat.float() if flat.dtype in _LOW_PRECISION else flat
    target = targets.flatten()
    if isinstance(flat, DTensor):
        target = DTensor.from_local(target, flat.device_mesh, [Replicate()], run_check=False)
        loss = F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum")
        return loss.to_local() if isinstance(loss, DTensor) else loss
    return F.cross_entropy(flat, target, ignore_index=ignore_index, reduction="sum")


def _slice_loss(decoder: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    if is_adaptive(decoder):
        keep = targets != ignore_index
        return -decoder(hidden[keep], targets[keep]).output.float().sum()
    return token_cross_entropy(decoder(hidden), targets, ignore_index)


def decoded_cross_entropy(hidden: torch.Tensor, decoder: nn.Module, targets: torch.Tensor,
                          ignore_index: int, slice_tokens: int | None = None) -> torch.Tensor:
    """Summed cross-entropy of ``decoder(hidden)`` against ``targets`` over the tokens that are not ``ignore_index``,
    a slice of :func:`chunk_tokens` tokens at a time (each recomputed in the backward pass).

    Args:
        hidden: ``(..., width)`` decoder inputs.
        decoder: an ``nn.Linear`` (or a subclass, or one split column-wise with torch's tensor-parallel API) or an
            ``nn.AdaptiveLogSoftmaxWithLoss``.
        targets: ``(...)`` target ids.
        ignore_index: the id that is not a token.
        slice_tokens: tokens per slice (``None``: :func:`chunk_tokens`).
    """
    flat, target = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    size = slice_tokens or chunk_tokens(decoder)
    if flat.shape[0] <= size:
        return _slice_loss(decoder, flat, target, ignore_index)
    total = None
    for start in range(0, flat.shape[0], size):
        piece = checkpoint(_slice_loss, decoder, flat[start:start + size], target[start:start + size], ignore_index,
                           use_reentrant=False)
        total = piece if total is None else total + piece
    assert total is not None
    return total


def _slice_predictions(decoder: nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if is_adaptive(decoder):
        log_probs = decoder.log_prob(hidden).float()
    else:
        logits = decoder(hidden)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()  # prediction needs every word
        log_probs = torch.log_softmax(logits.float(), dim=-1)
    picked = log_probs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked, log_probs.argmax(-1)


def decoded_predictions(hidden: torch.Tensor, decoder: nn.Module, targets: torch.Tensor,
                        ignore_index: int = 0, slice_tokens: int | None = None) -> dict[str, Any]:
    """Per-token target log-probabilities, the most likely next tokens and the target mask of ``(..., width)``
    hidden states, a slice of tokens at a time (no gradient; ``slice_tokens`` as :func:`decoded_cross_entropy`)."""
    shape = targets.shape
    flat, target = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    size = slice_tokens or chunk_tokens(decoder, every_word=True)
    with torch.no_grad():
        parts = [_slice_predictions(decoder, flat[i:i + size], target[i:i + size]) for i in range(0, len(flat), size)]
    picked = torch.cat([p for p, _ in parts]).reshape(shape)
    mask = targets != ignore_index
    return {"log_probs": picked.masked_fill(~mask, 0.0), "next_token": torch.cat([n for _, n in parts]).reshape(shape),
            "mask": mask}

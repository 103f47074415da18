"""Text generation from a trained :class:`~lightning_mp_lstm.LSTMLanguageModel`, on one process.

:func:`load_for_generation` rebuilds the one-process model and its :class:`~lightning_mp_lstm.data.vocab.Vocabulary`
from a checkpoint of any layout: one file (``checkpoint_format="file"``, or Lightning's own strategies) or a
sharded directory (``checkpoint_format="sharded"``, read without a process group). :func:`generate` samples
continuations of a prompt word by word, carrying every LSTM layer's ``(h, c)`` from step to step, with temperature
and top-k sampling from one seeded generator per sample (the same seed gives the same text on the same device).
:func:`generate_from_checkpoint` does both; ``generate.py`` is its command line.
"""

from __future__ import annotations

import hashlib
import math
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_mp_lstm.base.validation import check_positive_int
from lightning_mp_lstm.checkpoint import (
    SHARDED_METADATA,
    CheckpointError,
    is_sharded,
    load_sharded,
    local_model_state,
    read_checkpoint,
    with_aliases,
)
from lightning_mp_lstm.data.vocab import EOS, PAD, UNK, Vocabulary
from lightning_mp_lstm.models.lstm_language_model import LSTMLanguageModel
from lightning_mp_lstm.pipeline.tied import shared_parameter_aliases

__all__ = ["check_sampling", "generate", "generate_from_checkpoint", "generate_ids", "load_for_generation",
           "vocabulary_from_checkpoint"]

#: The key under which Lightning saves :class:`~lightning_mp_lstm.data.LMDataModule`'s state (its class name).
DATAMODULE_KEY = "LMDataModule"


# ----- checkpoints -----------------------------------------------------------------------------------------
def vocabulary_from_checkpoint(checkpoint: Mapping[str, Any], path: str | os.PathLike = "the checkpoint") -> Vocabulary:
    """The vocabulary a checkpoint's model was trained with.

    Lightning saves the data module's ``state_dict()`` under the data module's class name; for
    :class:`~lightning_mp_lstm.data.LMDataModule` (or a subclass) that is ``{"vocab": {"version": 1, "tokens":
    [...]}}``. The entry ``"LMDataModule"`` is looked at first, then any other top-level entry of that shape.

    Args:
        checkpoint: a loaded checkpoint dictionary (or a sharded checkpoint's metadata).
        path: the checkpoint's location, for the message.

    Raises:
        CheckpointError: the checkpoint holds no vocabulary, or one that cannot be read.
    """
    candidates = [DATAMODULE_KEY, *(k for k in checkpoint if k != DATAMODULE_KEY)]
    for key in candidates:
        state = checkpoint.get(key)
        if isinstance(state, Mapping) and isinstance(state.get("vocab"), Mapping):
            try:
                return Vocabulary.from_state_dict(state["vocab"])
            except ValueError as error:
                raise CheckpointError(f"{path}: the vocabulary saved under {key!r} cannot be read: {error}") from error
    raise CheckpointError(
        f"{path} holds no vocabulary: generation needs the words the model's ids stand for, which Lightning saves "
        f"from the data module's state (checkpoint entry {DATAMODULE_KEY!r} -> 'vocab'); train with "
        "lightning_mp_lstm.data.LMDataModule (trainer.fit(model, datamodule=...)) to get a checkpoint that has it"
    )


def _model_from_hyperparameters(checkpoint: Mapping[str, Any], path: str | os.PathLike) -> LSTMLanguageModel:
    hparams = checkpoint.get("hyper_parameters")
    if not isinstance(hparams, Mapping) or "vocab_size" not in hparams:
        raise CheckpointError(
            f"{path} holds no model hyperparameters ('hyper_parameters' with 'vocab_size'): it was not written "
            "for an LSTMLanguageModel"
        )
    # A normal one-process model on the CPU; its random initial values are overwritten by the checkpoint's, so
    # the global random state is left as it was.
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        try:
            return LSTMLanguageModel(**dict(hparams))
        except (TypeError, ValueError) as error:
            raise CheckpointError(f"{path}: its hyperparameters do not build an LSTMLanguageModel: {error}") from error


def load_for_generation(
    ckpt_path: str | os.PathLike, device: str | torch.device | None = None
) -> tuple[LSTMLanguageModel, Vocabulary]:
    """The one-process model and the vocabulary of a checkpoint written by any layout, ready to generate.

    The model is rebuilt from the checkpoint's ``hyper_parameters`` (saved by ``save_hyperparameters``) and its
    parameters are loaded strictly (every parameter, of the right shape). A sharded checkpoint directory is read
    with ``torch.distributed.checkpoint``'s one-process path: no process group is started.

    Args:
        ckpt_path: a checkpoint file, or a sharded checkpoint directory.
        device: where to put the model (``"cpu"``, ``"cuda"``, ``"cuda:1"``, ...); ``None``: the CPU.

    Returns:
        ``(model, vocab)``: the model in eval mode on ``device``, and its vocabulary.

    Raises:
        FileNotFoundError: there is no such file or directory.
        CheckpointError: a truncated or damaged checkpoint, a directory that is not a sharded checkpoint, one
            without hyperparameters or vocabulary, or parameters that do not fit the model they describe.
    """
    path = Path(ckpt_path)
    sharded = path.is_dir()
    if sharded and not is_sharded(path):
        raise CheckpointError(
            f"{path} is a directory but not a sharded checkpoint (it has no {SHARDED_METADATA}); give a checkpoint "
            "file or a directory written with checkpoint_format='sharded'"
        )
    checkpoint = read_checkpoint(path / SHARDED_METADATA if sharded else path, model_state=not sharded)
    vocab = vocabulary_from_checkpoint(checkpoint, path)
    model = _model_from_hyperparameters(checkpoint, path)
    if len(vocab) != model.hparams.vocab_size:
        raise CheckpointError(
            f"{path}: the vocabulary has {len(vocab):,} words but the model's vocab_size is "
            f"{model.hparams.vocab_size:,}: they do not belong together"
        )
    if sharded:
        with warnings.catch_warnings():  # the one-process path is what we want here
            warnings.filterwarnings("ignore", message=r".*torch\.distributed is disabled.*")
            state = load_sharded(path, model, [])["state_dict"]
    else:
        state = checkpoint["state_dict"]
    state = with_aliases(state, shared_parameter_aliases(model))  # a tied weight saved under its first name only
    state = local_model_state(model, state, full_keys=model.state_dict().keys(), source=str(path),
                              hint="it is not the model its hyperparameters describe")
    model.load_state_dict(state, strict=True)
    model.to(torch.device(device) if device is not None else torch.device("cpu"))
    return model.eval(), vocab


# ----- sampling --------------------------------------------------------------------------------------------
def check_sampling(num_samples: int, max_tokens: int, temperature: float, top_k: int | None, seed: int) -> None:
    """Check the sampling settings of :func:`generate`.

    Raises:
        ValueError: naming the setting, its value and what is allowed.
    """
    check_positive_int("num_samples", num_samples)
    check_positive_int("max_tokens", max_tokens)
    if (isinstance(temperature, bool) or not isinstance(temperature, (int, float))
            or not math.isfinite(temperature) or temperature <= 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r} (1.0 samples the model's "
                         "distribution; smaller is more conservative; for greedy decoding use top_k=1)")
    if top_k is not None:
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
            raise ValueError(f"top_k must be an integer >= 1 (1 is greedy decoding) or None (no limit), got {top_k!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an integer, got {seed!r}")


def _sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index``'s generator: independent of the number of samples, distinct across seeds."""
    digest = hashlib.sha256(f"lightning_mp_lstm.generation:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _advance(model: LSTMLanguageModel, tokens: torch.Tensor, state: list[Any] | None) -> tuple[torch.Tensor,
                                                                                             list[Any]]:
    """Run ``tokens`` (B, T) through the model from ``state``; return the logits of the last position (B, V) and the
    state every layer ended with (the model's own forward, in eval mode)."""
    logits, state = model(tokens, state)
    return logits[:, -1].float(), state


def _encode_prompt(vocab: Vocabulary, prompt: str) -> list[int]:
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string of whitespace-separated words, got {prompt!r}")
    words = prompt.split()
    if PAD in words:
        raise ValueError(f"the prompt contains the padding token {PAD}, which is not a word")
    unknown = [w for w in dict.fromkeys(words) if w not in vocab]
    if unknown:
        warnings.warn(f"prompt words not in the vocabulary, read as {UNK}: {', '.join(unknown)}", stacklevel=3)
    return vocab.encode(words)


def generate_ids(
    model: LSTMLanguageModel,
    vocab: Vocabulary,
    prompt: str = "",
    num_samples: int = 1,
    max_tokens: int = 40,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> tuple[list[int], list[list[int]]]:
    """Sample continuations of ``prompt`` as token ids; see :func:`generate`.

    Returns:
        ``(prompt_ids, samples)``: the prompt's ids (unknown words as ``<unk>``; without the sentence-start
        ``<eos>``) and, per sample, the generated ids: at most ``max_tokens``, ending with ``<eos>`` when the
        sample ended its sentence.

    Raises:
        ValueError: as :func:`generate`.
    """
    check_sampling(num_samples, max_tokens, temperature, top_k, seed)
    prompt_ids = _encode_prompt(vocab, prompt)
    return prompt_ids, _sample(model, vocab, prompt_ids, num_samples, max_tokens, temperature, top_k, seed)


def _sample(model: LSTMLanguageModel, vocab: Vocabulary, prompt_ids: list[int], num_samples: int, max_tokens: int,
            temperature: float, top_k: int | None, seed: int) -> list[list[int]]:
    if len(vocab) != model.hparams.vocab_size:
        raise ValueError(f"the vocabulary has {len(vocab):,} words but the model's vocab_size is "
                         f"{model.hparams.vocab_size:,}")
    if any(block is None for block in (model.embedding, model.decoder, *model.lstm)):
        raise ValueError("generation needs the whole model on one process; this one was split by a pipeline "
                         "strategy (load its checkpoint with load_for_generation)")
    device = next(model.parameters()).device
    eos = vocab.eos_id if EOS in vocab else None
    # The training data starts every sentence with <eos> as its first input, so a prompt (or nothing) follows it.
    context = ([eos] if eos is not None else []) + prompt_ids
    if not context:
        raise ValueError("an empty prompt needs an <eos> token in the vocabulary to start from")
    allowed = len(vocab) - 1  # every id but padding
    k = None if top_k is None or top_k >= allowed else top_k
    generators = [torch.Generator(device=device).manual_seed(_sample_seed(seed, i)) for i in range(num_samples)]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            tokens = torch.tensor([context], dtype=torch.long, device=device)
            logits, state = _advance(model, tokens, None)
            logits = logits.expand(num_samples, -1)
            state = [(h.expand(-1, num_samples, -1).contiguous(), c.expand(-1, num_samples, -1).contiguous())
                     for h, c in state]
            samples: list[list[int]] = [[] for _ in range(num_samples)]
            running = list(range(num_samples))
            for _ in range(max_tokens):
                scores = logits / temperature
                scores[:, vocab.pad_id] = -math.inf  # padding is never a word
                if k is not None:
                    kth = scores.topk(k, dim=-1).values[:, -1:]
                    scores = scores.masked_fill(scores < kth, -math.inf)
                probs = torch.softmax(scores, dim=-1)
                chosen = torch.empty(num_samples, dtype=torch.long, device=device)
                for row in range(num_samples):
                    if k == 1:  # greedy: no randomness (and no tie at the k-th value to resolve)
                        chosen[row] = scores[row].argmax()
                    else:
                        chosen[row] = torch.multinomial(probs[row], 1, generator=generators[row])[0]
                for row in running:
                    samples[row].append(int(chosen[row]))
                running = [row for row in running if samples[row][-1] != eos]
                if not running:
                    break
                logits, state = _advance(model, chosen[:, None], state)
    finally:
        model.train(was_training)
    return samples


def generate(
    model: LSTMLanguageModel,
    vocab: Vocabulary,
    prompt: str = "",
    num_samples: int = 1,
    max_tokens: int = 40,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
) -> list[str]:
    """Sample ``num_samples`` continuations of ``prompt`` from a language model.

    The prompt is split at whitespace and read after the sentence-start token ``<eos>`` (how every training
    sentence begins); words not in the vocabulary are read as ``<unk>``, with a warning naming them. Each step
    runs one token through the model, carrying every LSTM layer's ``(h, c)``, divides the next-token logits by
    ``temperature``, keeps the ``top_k`` largest (padding is never drawn) and draws from the softmax with the
    sample's own ``torch.Generator``, seeded from ``seed`` and the sample's index: the same seed gives the same
    samples on the same device, and sample ``i`` does not depend on ``num_samples``. A sample ends at ``<eos>`` or
    after ``max_tokens`` tokens. The model runs where its parameters are, in eval mode (restored afterwards).

    Args:
        model: a whole one-process model (e.g. from :func:`load_for_generation`).
        vocab: its vocabulary.
        prompt: whitespace-separated words to continue; empty: start a new sentence.
        num_samples: how many samples.
        max_tokens: the most tokens generated per sample (``<eos>`` included).
        temperature: > 0; below 1 sharpens the distribution, above 1 flattens it.
        top_k: draw only among the ``top_k`` most likely tokens; ``1`` is greedy decoding, ``None`` no limit.
        seed: the random seed.

    Returns:
        One string per sample: the prompt as the model read it (unknown words as ``<unk>``) followed by the
        generated words, space-separated, without the final ``<eos>``.

    Raises:
        ValueError: a setting out of range (named with its value and what is allowed), a prompt containing
            ``<pad>``, a vocabulary of another size than the model's, or a model that is not whole.
    """
    prompt_ids, samples = generate_ids(model, vocab, prompt, num_samples, max_tokens, temperature, top_k, seed)
    eos = vocab.eos_id if EOS in vocab else None
    return [" ".join(vocab.decode(prompt_ids + [i for i in sample if i != eos])) for sample in samples]


def generate_from_checkpoint(
    ckpt_path: str | os.PathLike,
    prompt: str = "",
    num_samples: int = 5,
    max_tokens: int = 40,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    device: str | torch.device | None = None,
) -> list[str]:
    """:func:`load_for_generation` then :func:`generate` (what ``python generate.py`` runs). The sampling
    settings are checked before the checkpoint is read.

    Raises:
        FileNotFoundError: no such checkpoint.
        CheckpointError: see :func:`load_for_generation`.
        ValueError: see :func:`generate`.
    """
    check_sampling(num_samples, max_tokens, temperature, top_k, seed)
    if ckpt_path is None or str(ckpt_path) == "":
        raise ValueError("ckpt_path is required: a checkpoint file or a sharded checkpoint directory")
    model, vocab = load_for_generation(ckpt_path, device=device)
    return generate(model, vocab, prompt, num_samples, max_tokens, temperature, top_k, seed)

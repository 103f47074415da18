"""The bucketed multi-layer LSTM language model: embedding, ``num_layers`` one-layer LSTMs, decoder.

An ordinary LightningModule: its own ``forward`` and steps train it on one process (carrying every layer's
``(h, c)`` across batches with ``carry_state``), and its :meth:`LSTMLanguageModel.configure_pipeline` declaration is
all the ``mp_lstm`` strategy needs to split it (blocks ``embedding``, ``lstm.0`` ... ``lstm.{N-1}``, ``decoder``),
the same way as any user's model. Every block's initial values depend only on its name and the model's seed, so a
model built on the meta device and materialized block by block equals the one built whole.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from typing_extensions import override

from lightning_mp_lstm.base.validation import check_positive_int
from lightning_mp_lstm.models.blocks import without_autocast
from lightning_mp_lstm.models.declaration import LSTMBlocks
from lightning_mp_lstm.models.decoded_loss import decoded_cross_entropy, decoded_predictions
from lightning_mp_lstm.models.language_model_blocks import prediction_from_logits
from lightning_mp_lstm.models.metrics import LanguageModelMetrics, perplexity
from lightning_mp_lstm.models.objective import token_cross_entropy
from lightning_mp_lstm.models.optimizer_kernels import kernel_options, make_optimizer
from lightning_mp_lstm.models.vocab_padding import PaddedDecoder, padded_vocab_size

__all__ = ["ADAPTIVE_ABOVE", "OPTIMIZERS", "SOFTMAXES", "LSTMLanguageModel", "adaptive_cutoffs", "block_names",
           "perplexity", "prediction_from_logits", "token_loss_sum"]

#: Optimizers by name (or give ``optimizer`` a callable: ``params -> torch.optim.Optimizer``).
OPTIMIZERS = ("sgd", "adam", "adamw")
#: The decoders: a full softmax over the vocabulary (``nn.Linear`` + cross-entropy), torch's adaptive softmax, or
#: ``"auto"``: adaptive above :data:`ADAPTIVE_ABOVE` words (unless the weights are tied), else full.
SOFTMAXES = ("full", "adaptive", "auto")
#: ``softmax="auto"`` is adaptive for vocabularies larger than this: where AWD-LSTM splits its softmax (WikiText-103).
ADAPTIVE_ABOVE = 75_000


def adaptive_cutoffs(vocab_size: int) -> list[int]:
    """The adaptive softmax's cluster boundaries for a vocabulary of ``vocab_size`` words (ids by decreasing
    frequency): AWD-LSTM's splits, ``[2800, 20000, 76000]`` above 75,000 words (WikiText-103) and
    ``[4200, 35000, 180000]`` above 500,000 (the One Billion Word benchmark); a shortlist of a tenth of the words and
    a second cluster to 40 % below.

    Raises:
        ValueError: a vocabulary too small to split (fewer than 10 words).
    """
    if vocab_size > 500_000:
        return [4200, 35000, 180000]
    if vocab_size > 75_000:
        return [cut for cut in (2800, 20000, 76000) if cut < vocab_size - 1]
    if vocab_size < 10:
        raise ValueError(f"an adaptive softmax needs at least 10 words to split into clusters, got {vocab_size}")
    return sorted({max(1, vocab_size // 10), max(2, vocab_size * 2 // 5)})


def block_names(num_layers: int) -> list[str]:
    """Names of the blocks of a ``num_layers`` model, in model order."""
    return ["embedding", *(f"lstm.{i}" for i in range(num_layers)), "decoder"]


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over real (non-padding, id != 0) target tokens."""
    return token_cross_entropy(logits, targets, ignore_index=0)


class LSTMLanguageModel(pl.LightningModule):
    """Embedding, ``num_layers`` LSTM layers and a decoder; the loss is the mean over real (non-padding, id != 0)
    target tokens.

    Args:
        vocab_size: size of the vocabulary (id 0 is padding).
        embedding_dim: width of the word embedding.
        hidden_size: width of every LSTM layer.
        num_layers: number of LSTM layers (block ``lstm.i`` each).
        dropout: dropout on the embedding and on every LSTM output.
        tie_weights: share the embedding matrix with the decoder (needs ``embedding_dim == hidden_size``).
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"`` (with ``lr``, ``momentum``, ``weight_decay``), or a callable
            ``params -> optimizer`` that carries its own settings (a Hydra ``_partial_`` config).
        lr: learning rate of a named optimizer.
        momentum: SGD momentum of a named optimizer.
        weight_decay: weight decay of a named optimizer.
        lr_decay: multiplicative learning-rate decay per epoch (1.0 = constant), when no ``scheduler`` is given.
        scheduler: a callable ``optimizer -> LR scheduler`` stepped every epoch (a Hydra ``_partial_`` config).
        init_range: parameters are drawn from ``uniform(-init_range, init_range)`` (MXNet's model-parallel LSTM
            example's init); ``None`` keeps PyTorch's defaults.
        carry_state: truncated backpropagation through time over a token stream (``LMDataModule(mode="stream")``):
            every LSTM layer starts a batch from the ``(h, c)`` its rows ended the previous batch with (detached);
            reset at the start of every training epoch and evaluation, kept apart for training and evaluation.
        pad_vocab_to_multiple_of: give the embedding and decoder a multiple of this many rows (Megatron's
            ``make_vocab_size_divisible_by``), so that ``tensor_parallel_size`` can split them evenly. The padding
            ids get a logit of ``-inf`` (:class:`~lightning_mp_lstm.models.vocab_padding.PaddedDecoder`): never
            predicted, never sampled, no probability taken from the real words, so losses and perplexities are the
            unpadded model's. ``vocab_size`` stays the real vocabulary's size.
        softmax: ``"full"``: a linear decoder onto every word (its logits computed a slice of tokens at a time in the
            loss, :mod:`~lightning_mp_lstm.models.decoded_loss`); ``"adaptive"``:
            ``torch.nn.AdaptiveLogSoftmaxWithLoss`` (Grave et al. 2017, as WikiText-103 LSTMs train), whose
            log-probabilities, loss and perplexity are exact; ``"auto"``: adaptive for a vocabulary of more than
            :data:`ADAPTIVE_ABOVE` words (unless ``tie_weights``), else full (``hparams.softmax`` keeps the choice).
        cutoffs: the adaptive softmax's cluster boundaries (``None``: :func:`adaptive_cutoffs`).
        div_value: how much narrower each adaptive cluster's projection is than the previous one's.
        loss_chunk_tokens: tokens per slice of the loss (``None``: as many as 64 MiB of logits hold).
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int = 200,
        hidden_size: int = 200,
        num_layers: int = 2,
        dropout: float = 0.0,
        tie_weights: bool = False,
        optimizer: str | Callable[..., torch.optim.Optimizer] = "sgd",
        lr: float = 1.0,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_decay: float = 1.0,
        scheduler: Callable[..., Any] | None = None,
        init_range: float | None = 0.1,
        carry_state: bool = False,
        pad_vocab_to_multiple_of: int = 1,
        softmax: str = "full",
        cutoffs: list[int] | None = None,
        div_value: float = 4.0,
        loss_chunk_tokens: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("embedding_dim", embedding_dim),
                            ("hidden_size", hidden_size), ("num_layers", num_layers),
                            ("pad_vocab_to_multiple_of", pad_vocab_to_multiple_of)):
            check_positive_int(name, value)
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if loss_chunk_tokens is not None:
            check_positive_int("loss_chunk_tokens", loss_chunk_tokens)
        if softmax not in SOFTMAXES:
            raise ValueError(f"unknown softmax {softmax!r}; allowed: {', '.join(SOFTMAXES)}")
        if softmax == "auto":  # resolved before save_hyperparameters reads it: a checkpoint names its decoder
            softmax = "adaptive" if vocab_size > ADAPTIVE_ABOVE and not tie_weights else "full"
        if softmax == "adaptive" and tie_weights:
            raise ValueError("tie_weights=True shares the embedding with a linear decoder; an adaptive softmax has "
                             "no such matrix: use softmax='full' to tie, or tie_weights=False")
        if tie_weights and embedding_dim != hidden_size:
            raise ValueError(
                f"tie_weights=True needs embedding_dim == hidden_size, got {embedding_dim} and {hidden_size}"
            )
        if isinstance(optimizer, str) and optimizer.lower() not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {optimizer!r}; allowed: {', '.join(OPTIMIZERS)}, or a callable "
                             "params -> optimizer")
        # Optimizer and scheduler factories (Hydra partials) stay out of the hyperparameters: checkpoints then hold
        # plain values only and load with torch's weights-only unpickler (Lightning 2.6 passes no weights_only to a
        # strategy that restores after setup, as mp_lstm does).
        self.optimizer_factory = optimizer if callable(optimizer) else None
        self.scheduler_factory = scheduler
        self.save_hyperparameters(ignore=[name for name, value in (("optimizer", optimizer), ("scheduler", scheduler))
                                          if callable(value)])
        # Every block's initial values derive from this seed and the block's name (drawn from the global generator,
        # so seeding before construction fixes the model).
        self._init_seed = int(torch.randint(0, 2**62, (1,), device="cpu"))
        with torch.random.fork_rng(devices=[]):  # torch's default initialization, overwritten below: no global draw
            rows = padded_vocab_size(vocab_size, pad_vocab_to_multiple_of)
            self.embedding = nn.Embedding(rows, embedding_dim)
            self.lstm = nn.ModuleList(nn.LSTM(embedding_dim if i == 0 else hidden_size, hidden_size, batch_first=True)
                                      for i in range(num_layers))
            self.dropout = nn.Dropout(dropout)
            if softmax == "adaptive":
                cutoffs = list(cutoffs) if cutoffs is not None else adaptive_cutoffs(vocab_size)
                if hidden_size // div_value ** len(cutoffs) < 1:
                    raise ValueError(f"an adaptive softmax of {len(cutoffs)} clusters from {hidden_size} units with "
                                     f"div_value={div_value} leaves its last cluster a projection 0 wide; use a "
                                     "smaller div_value or fewer cutoffs")
                self.decoder = nn.AdaptiveLogSoftmaxWithLoss(hidden_size, vocab_size, cutoffs, div_value=div_value)
            else:
                self.decoder = (PaddedDecoder(hidden_size, rows, words=vocab_size) if rows > vocab_size
                                else nn.Linear(hidden_size, vocab_size))
        if not self.embedding.weight.is_meta:  # built on the meta device: the strategy materializes the blocks
            for name, module in zip(block_names(num_layers), [self.embedding, *self.lstm, self.decoder], strict=True):
                self._init_block(name, module)
        if tie_weights:
            self.decoder.weight = self.embedding.weight
        self.metrics = LanguageModelMetrics("{split}/{metric}")
        self._state: dict[str, list[Any]] = {}

    def configure_pipeline(self) -> LSTMBlocks:
        """What the ``mp_lstm`` strategy splits: the same declaration any user's model gives."""
        return LSTMBlocks(embedding="embedding", lstm="lstm", decoder="decoder", dropout="dropout",
                          layer_dropout="dropout", ignore_index=0, carry_state=bool(self.hparams.carry_state),
                          init=self._init_block, loss_chunk_tokens=self.hparams.loss_chunk_tokens,
                          log_name="{split}/{metric}")

    def _init_block(self, name: str, module: nn.Module) -> None:
        """Block ``name``'s initial values, from a generator seeded by the model's seed and the block's name only
        (so they do not depend on which other blocks exist, on the device, or on the global random state)."""
        seed = (self._init_seed ^ zlib.crc32(name.encode())) % 2**63
        init_range = self.hparams.init_range
        with torch.no_grad():
            if init_range is None:
                with torch.random.fork_rng(devices=[]):
                    torch.default_generator.manual_seed(seed)
                    module.reset_parameters()
                return
            generator = torch.Generator().manual_seed(seed)
            for parameter in module.parameters():
                parameter.copy_(torch.empty(parameter.shape).uniform_(-init_range, init_range, generator=generator))

    # ----- computation ----------------------------------------------------------------------------------------
    @override
    def forward(self, tokens: torch.Tensor, state: list[Any] | None = None) -> tuple[torch.Tensor, list[Any]]:
        """Logits (B, T, V) of token ids (B, T) (the adaptive softmax's log-probabilities), starting every layer from
        ``state`` (one ``(h, c)`` or ``None`` per layer), and the state each layer ended with. Every word of every
        token at once: for sampling; the steps decode a slice of tokens at a time."""
        x, ended = self.features(tokens, state)
        return (self.decoder.log_prob(x.flatten(0, 1)).unflatten(0, x.shape[:2]) if self.hparams.softmax == "adaptive"
                else self.decoder(x)), ended

    def features(self, tokens: torch.Tensor, state: list[Any] | None = None) -> tuple[torch.Tensor, list[Any]]:
        """The decoder's inputs (B, T, hidden) of token ids (B, T), and the state each layer ended with."""
        x = self.dropout(self.embedding(tokens))
        ended = []
        with without_autocast(x):  # the LSTMs in their weights' dtype, as under mp_lstm (blocks.without_autocast)
            for layer, hx in zip(self.lstm, state or [None] * len(self.lstm), strict=True):
                x, hx = layer(x.to(layer.weight_ih_l0.dtype), hx)
                x = self.dropout(x)
                ended.append(hx)
        return x, ended

    def _carried(self, mode: str) -> list[Any] | None:
        """The state the last batch of ``mode`` ended with, when the model carries it."""
        return self._state.get(mode) if self.hparams.carry_state else None

    def _keep(self, mode: str, state: list[Any]) -> None:
        if self.hparams.carry_state:
            self._state[mode] = [(h.detach(), c.detach()) for h, c in state]

    def _loss(self, batch: Any, mode: str) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch[0], batch[1]
        hidden, state = self.features(inputs, self._carried(mode))
        self._keep(mode, state)
        tokens = (targets != 0).sum()
        loss = decoded_cross_entropy(hidden, self.decoder, targets, 0, self.hparams.loss_chunk_tokens)
        return loss / tokens.clamp(min=1), tokens

    # ----- Lightning hooks (one process; under mp_lstm the strategy runs the steps) ---------------------------
    @override
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, tokens = self._loss(batch, "train")
        self.metrics.log(self, "train", loss.detach(), tokens, rows=int(batch[0].shape[0]))
        return loss

    @override
    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        if batch_idx == 0:
            self._state.pop("eval", None)  # each dataloader starts the stream again
        loss, tokens = self._loss(batch, "eval")
        self.metrics.log(self, "val", loss, tokens, rows=int(batch[0].shape[0]), dataloader_idx=dataloader_idx)
        return loss

    @override
    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> torch.Tensor:
        if batch_idx == 0:
            self._state.pop("eval", None)  # each dataloader starts the stream again
        loss, tokens = self._loss(batch, "eval")
        self.metrics.log(self, "test", loss, tokens, rows=int(batch[0].shape[0]), dataloader_idx=dataloader_idx)
        return loss

    @override
    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        """Per-token log-probability of each target and the most likely next token.

        Returns:
            dict with ``log_probs`` (B, T) float, ``next_token`` (B, T) int64 and ``mask`` (B, T) bool (True on
            real tokens).
        """
        if batch_idx == 0:
            self._state.pop("eval", None)  # each dataloader starts the stream again
        hidden, ended = self.features(batch[0], self._carried("eval"))
        self._keep("eval", ended)
        return decoded_predictions(hidden, self.decoder, batch[1], 0, self.hparams.loss_chunk_tokens)

    @override
    def on_train_epoch_start(self) -> None:
        self.metrics.start_epoch()
        self._state.pop("train", None)

    def _fused_allowed(self) -> bool:
        """Whether the optimizer may take torch's fused kernel: not where Lightning's mixed-precision plugin will clip
        its gradients (one process under ``16-mixed``/``bf16-mixed`` with clipping), which it refuses for a fused
        optimizer ("does not allow for gradient clipping because it performs unscaling of gradients internally")."""
        trainer = self._trainer
        if trainer is None or not isinstance(trainer.precision_plugin, MixedPrecision):
            return True
        return not (trainer.gradient_clip_val or is_overridden("configure_gradient_clipping", self, pl.LightningModule))

    @override
    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        fused = self._fused_allowed()
        if self.optimizer_factory is not None:
            opt = make_optimizer(self.optimizer_factory, params, fused)
        else:
            kinds = {"sgd": (torch.optim.SGD, {"momentum": hp.momentum}), "adam": (torch.optim.Adam, {}),
                     "adamw": (torch.optim.AdamW, {})}
            kind, extra = kinds[hp.optimizer.lower()]
            opt = kind(params, lr=hp.lr, weight_decay=hp.weight_decay, **kernel_options(params, fused), **extra)
        if self.scheduler_factory is not None:
            return {"optimizer": opt, "lr_scheduler": self.scheduler_factory(opt)}
        if hp.lr_decay == 1.0:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, gamma=hp.lr_decay)}

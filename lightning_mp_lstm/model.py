"""The bucketed multi-layer LSTM language model, built from named blocks a strategy can split.

Blocks, in model order: ``embedding``, ``lstm.0`` ... ``lstm.{N-1}``, ``decoder``. Removing blocks
(:meth:`LSTMLanguageModel.keep_blocks`) never renames a parameter, so one checkpoint serves every layout.
The model implements :class:`~lightning_mp_lstm.contract.PipelineModel`: every block's initial values depend
only on its name and the model's seed, so a model built on the meta device and materialized block by block
(:meth:`LSTMLanguageModel.materialize_blocks`) equals the one built whole.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from lightning_mp_lstm import costs

__all__ = ["LSTMLanguageModel", "block_names", "perplexity", "prediction_from_logits", "token_loss_sum"]


def block_names(num_layers: int) -> list[str]:
    """Names of the blocks of a ``num_layers`` model, in model order."""
    return ["embedding", *(f"lstm.{i}" for i in range(num_layers)), "decoder"]


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of cross-entropy over real (non-padding, id != 0) target tokens."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=0, reduction="sum")


class _Embedding(nn.Embedding):
    def __init__(self, vocab_size: int, embedding_dim: int, dropout: float) -> None:
        super().__init__(vocab_size, embedding_dim)
        self.dropout = nn.Dropout(dropout)
        #: Set once the rows are sharded: dropout then runs in a forward hook after the all-reduce of the lookup.
        self.dropout_after_hooks = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out = super().forward(tokens)
        return out if self.dropout_after_hooks else self.dropout(out)


class _LSTMLayer(nn.LSTM):
    """One LSTM layer; batch-first in and out, contiguous output, dropout on the output.

    With a ``slot`` set (see :meth:`LSTMLanguageModel.microbatch_context`) it starts from the ``(h, c)`` it kept
    for that slot and keeps the final one, detached: truncated backpropagation through time.
    """

    def __init__(self, input_size: int, hidden_size: int, dropout: float) -> None:
        super().__init__(input_size, hidden_size, batch_first=True)
        self.output_dropout = nn.Dropout(dropout)  # nn.LSTM owns the name ``dropout``
        self.slot: tuple[str, int] | None = None
        self.carried: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        state = self.carried.get(self.slot) if self.slot is not None else None
        if state is not None and state[0].shape[1] != x.shape[0]:
            raise ValueError(
                f"carry_state: a batch of {x.shape[0]} rows follows one of {state[0].shape[1]} rows in the same "
                "stream; carried state needs a constant number of rows (LMDataModule(mode='stream'))"
            )
        out, (h, c) = super().forward(x, state)
        if self.slot is not None:
            self.carried[self.slot] = (h.detach(), c.detach())
        return self.output_dropout(out).contiguous()


class _Decoder(nn.Linear):
    pass


class LSTMLanguageModel(pl.LightningModule):
    """Embedding, ``num_layers`` LSTM layers and a decoder, as named, separable blocks.

    The loss of a batch is the sum of token cross-entropies over real (unpadded) tokens divided by the
    number of real tokens in the whole batch. When a pipeline strategy is attached (``self.pipeline``),
    the same quantities come from the pipeline instead of a local forward pass.

    Args:
        vocab_size: size of the vocabulary (id 0 is padding).
        embedding_dim: width of the word embedding.
        hidden_size: width of every LSTM layer.
        num_layers: number of LSTM layers, each its own block ``lstm.i``.
        dropout: dropout on the embedding and on every LSTM output.
        tie_weights: share the embedding matrix with the decoder (needs ``embedding_dim == hidden_size``).
        optimizer: ``"sgd"``, ``"adam"`` or ``"adamw"``.
        lr: learning rate.
        momentum: SGD momentum.
        weight_decay: weight decay.
        lr_decay: multiplicative learning-rate decay per epoch (1.0 = constant).
        init_range: parameters are drawn from ``uniform(-init_range, init_range)`` (the seed's init);
            ``None`` keeps PyTorch's defaults.
        carry_state: truncated backpropagation through time over a token stream
            (``LMDataModule(mode="stream")``): every LSTM layer starts each batch from the ``(h, c)`` its rows
            ended the previous batch with (detached); reset at the start of every training epoch and of every
            evaluation, kept apart for training and evaluation.
    """

    def __init__(
        self,
        vocab_size: int,
        embedding_dim: int = 200,
        hidden_size: int = 200,
        num_layers: int = 2,
        dropout: float = 0.0,
        tie_weights: bool = False,
        optimizer: str = "sgd",
        lr: float = 1.0,
        momentum: float = 0.0,
        weight_decay: float = 0.0,
        lr_decay: float = 1.0,
        init_range: float | None = 0.1,
        carry_state: bool = False,
    ) -> None:
        super().__init__()
        for name, value in (("vocab_size", vocab_size), ("embedding_dim", embedding_dim),
                            ("hidden_size", hidden_size), ("num_layers", num_layers)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if tie_weights and embedding_dim != hidden_size:
            raise ValueError(
                f"tie_weights=True needs embedding_dim == hidden_size, got {embedding_dim} and {hidden_size}"
            )
        if optimizer.lower() not in ("sgd", "adam", "adamw"):
            raise ValueError(f"unknown optimizer {optimizer!r}; allowed: sgd, adam, adamw")
        self.save_hyperparameters()
        # Every block's initial values derive from this seed and the block's name (drawn from the global
        # generator, so seeding before construction fixes the model).
        self._init_seed = int(torch.randint(0, 2**62, (1,), device="cpu"))
        meta = torch.empty(0).device.type == "meta"  # built under torch.device("meta"): no storage yet
        built = {name: self._new_block(name) if meta else self._initial_block(name) for name in self.block_names}
        # Registered in model order: named_parameters() order is what optimizers pair saved state by.
        self.embedding: nn.Module | None = built["embedding"]
        self.lstm = nn.ModuleDict({name[5:]: built[name] for name in self.block_names if name.startswith("lstm.")})
        self.decoder: nn.Module | None = built["decoder"]
        self._tie()
        #: Set by a pipeline strategy; ``None`` means a plain local forward pass.
        self.pipeline: Any = None
        self._last_step_time: float | None = None
        self._eval_sums: dict[str, tuple[float, int]] = {}

    # ----- blocks ---------------------------------------------------------------------------------
    @property
    def block_names(self) -> list[str]:
        """All block names of the full model, in order (also after pruning)."""
        return block_names(self.hparams.num_layers)

    def _new_block(self, name: str) -> nn.Module:
        """Block ``name`` with PyTorch's initialization, on the current default device."""
        hp = self.hparams
        if name == "embedding":
            return _Embedding(hp.vocab_size, hp.embedding_dim, hp.dropout)
        if name == "decoder":
            return _Decoder(hp.hidden_size, hp.vocab_size)
        layer = int(name.split(".", 1)[1])
        return _LSTMLayer(hp.embedding_dim if layer == 0 else hp.hidden_size, hp.hidden_size, hp.dropout)

    def _initial_block(self, name: str) -> nn.Module:
        """Block ``name`` with its initial values, on the CPU: drawn from a generator seeded by the model's seed
        and the block's name only, so they do not depend on which other blocks exist (or on the device)."""
        seed = (self._init_seed ^ zlib.crc32(name.encode())) % 2**63
        with torch.random.fork_rng(devices=[]), torch.device("cpu"):
            torch.manual_seed(seed)
            block = self._new_block(name)
            if self.hparams.init_range is not None:
                for parameter in block.parameters():
                    nn.init.uniform_(parameter, -self.hparams.init_range, self.hparams.init_range)
        return block

    def _set_block(self, name: str, module: nn.Module | None) -> None:
        if name.startswith("lstm."):
            if module is None:
                if name[5:] in self.lstm:
                    del self.lstm[name[5:]]
            else:
                self.lstm[name[5:]] = module
        else:
            setattr(self, name, module)

    def _tie(self) -> None:
        if self.hparams.tie_weights and self.embedding is not None and self.decoder is not None:
            self.decoder.weight = self.embedding.weight

    def materialize_blocks(self, names: Sequence[str], device: torch.device) -> None:
        """Give the blocks ``names`` that are still on the meta device their initial values, on ``device``."""
        for name, module in self.blocks(list(names)):
            if any(p.is_meta for p in module.parameters()):
                self._set_block(name, self._initial_block(name).to(device))
                if name == "decoder" and self.hparams.tie_weights and self.embedding is None:
                    # The embedding is on another process: this copy of the shared weight starts as it does.
                    self.decoder.weight = nn.Parameter(self._initial_block("embedding").weight.detach().to(device))
        self._tie()

    def build_block(self, name: str, device: torch.device) -> nn.Module:
        """A new block ``name`` on ``device`` (for timing; the global random state is left alone)."""
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
            return self._new_block(name)

    def example_input(self, name: str, rows: int, length: int, device: torch.device) -> torch.Tensor:
        """Token ids for the embedding, activations of the right width for the other blocks."""
        hp = self.hparams
        if name == "embedding":
            return torch.randint(1, hp.vocab_size, (rows, length), device=device)
        width = hp.embedding_dim if name == "lstm.0" else hp.hidden_size
        return torch.randn(rows, length, width, device=device)

    def example_targets(self, rows: int, length: int, device: torch.device) -> torch.Tensor:
        """Random next-token ids (no padding)."""
        return torch.randint(1, self.hparams.vocab_size, (rows, length), device=device)

    def microbatch_loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy over the real (non-padding) target tokens.

        With a vocabulary-parallel decoder (:meth:`parallelize_vocabulary`) ``outputs`` are logits sharded on the
        vocabulary; the loss is then computed by ``loss_parallel`` (enter :meth:`loss_context` around the forward
        *and* backward) without gathering them, and returned as a plain tensor, equal on every shard.
        """
        if isinstance(outputs, DTensor):
            logits = outputs.flatten(0, 1).float()
            target = DTensor.from_local(targets.flatten(), outputs.device_mesh, [Replicate()], run_check=False)
            loss = F.cross_entropy(logits, target, ignore_index=0, reduction="sum")
            return loss.to_local() if isinstance(loss, DTensor) else loss
        return token_loss_sum(outputs, targets)

    # ----- tensor parallel ------------------------------------------------------------------------
    def check_tensor_parallel(self, size: int) -> None:
        """Raise ``ValueError`` unless the vocabulary layers can be split over ``size`` processes.

        The vocabulary must be a multiple of ``size`` (every shard holds as many rows of the embedding and of
        the decoder: ``LMDataModule`` vocabularies are not padded on their own), and tied weights are not split.
        """
        hp = self.hparams
        if size > 1 and hp.vocab_size % size:
            nearest = -(-hp.vocab_size // size) * size
            raise ValueError(
                f"tensor_parallel_size={size} splits the vocabulary into equal shards, but vocab_size="
                f"{hp.vocab_size} is not a multiple of {size}; use a tensor_parallel_size that divides it "
                f"({[d for d in range(1, min(hp.vocab_size, 64) + 1) if hp.vocab_size % d == 0]}) or pad the "
                f"vocabulary to {nearest} words (ids the data never uses)"
            )
        if size > 1 and hp.tie_weights:
            raise ValueError(
                f"tensor_parallel_size={size} does not split tied embedding and decoder weights; use "
                "tie_weights=False or tensor_parallel_size=1"
            )

    def tensor_parallel_blocks(self) -> list[str]:
        """The blocks :meth:`parallelize_vocabulary` splits (every parameter of them): embedding and decoder."""
        return ["embedding", "decoder"]

    def parallelize_vocabulary(self, mesh: DeviceMesh) -> None:
        """Split the vocabulary layers this process holds over the one-dimensional ``mesh``.

        With torch's tensor-parallel API (``parallelize_module``): the decoder column-wise (each process computes
        the logits of its slice of the vocabulary, left sharded for ``loss_parallel``), the embedding row-wise
        (each process looks up the words of its slice, the partial sums are all-reduced). Every other block is
        replicated: its gradients are equal on every shard. Call it after the blocks have their values.
        """
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        self.check_tensor_parallel(mesh.size())
        if mesh.size() == 1:
            return
        # Idempotent: the strategy sets up again for validate/test/predict after fit, on the split model.
        if self.decoder is not None and not isinstance(self.decoder.weight, DTensor):
            parallelize_module(self.decoder, mesh,
                               ColwiseParallel(output_layouts=Shard(-1), use_local_output=False))
        if self.embedding is not None and not isinstance(self.embedding.weight, DTensor):
            parallelize_module(self.embedding, mesh,
                               RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()))
            # Dropout after the lookup's all-reduce (a forward hook after torch's), on a plain tensor.
            self.embedding.dropout_after_hooks = True
            self.embedding.register_forward_hook(lambda module, args, out: module.dropout(out))

    def loss_context(self) -> AbstractContextManager[Any]:
        """The context the loss's forward and backward run in: ``loss_parallel`` when the decoder is split."""
        if self.decoder is not None and isinstance(self.decoder.weight, DTensor):
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return nullcontext()

    def loss_weight(self, targets: torch.Tensor) -> torch.Tensor:
        """The number of real (non-padding) target tokens."""
        return (targets != 0).sum()

    def pad_rows(self, inputs: torch.Tensor, targets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``rows`` all-padding rows (id 0), which add nothing to the loss."""
        return (torch.cat([inputs, inputs.new_zeros((rows, *inputs.shape[1:]))]),
                torch.cat([targets, targets.new_zeros((rows, *targets.shape[1:]))]))

    def predictions(self, outputs: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
        """See :meth:`predict_step` (vocabulary-sharded logits are gathered first: prediction needs every word)."""
        if isinstance(outputs, DTensor):
            outputs = outputs.full_tensor()
        return prediction_from_logits(outputs, targets)

    def analytic_costs(self, kind: str, rows: int, length: int) -> dict[str, float]:
        """``"flops"`` of a ``rows x length`` batch, ``"memory"`` bytes or ``"parameters"`` of every block."""
        hp = self.hparams
        shape = costs.ModelShape(hp.vocab_size, hp.embedding_dim, hp.hidden_size, hp.num_layers, bool(hp.tie_weights))
        if kind == "flops":
            return costs.flop_costs(shape, rows, [length])
        if kind == "memory":
            optimizer = hp.optimizer.lower()
            name = "adam" if optimizer != "sgd" else ("sgd_momentum" if hp.momentum else "sgd")
            return costs.memory_costs(shape, optimizer=name)
        if kind == "parameters":
            return {k: float(v) for k, v in costs.parameter_counts(shape).items()}
        raise ValueError(f"unknown cost kind {kind!r}; allowed: flops, memory, parameters")

    def blocks(self, names: list[str] | None = None) -> list[tuple[str, nn.Module]]:
        """The present blocks (optionally only ``names``), in model order."""
        present = []
        for name in self.block_names:
            module = self._block(name)
            if module is not None and (names is None or name in names):
                present.append((name, module))
        if names is not None:
            missing = sorted(set(names) - {n for n, _ in present})
            if missing:
                raise KeyError(f"blocks {missing} are not on this model; present: {[n for n, _ in present]}")
        return present

    def _block(self, name: str) -> nn.Module | None:
        if name.startswith("lstm."):
            return self.lstm[name[5:]] if name[5:] in self.lstm else None
        return getattr(self, name)

    def keep_blocks(self, names: list[str]) -> None:
        """Remove every block not in ``names``; parameter names of the kept blocks do not change."""
        unknown = sorted(set(names) - set(self.block_names))
        if unknown:
            raise KeyError(f"unknown block names {unknown}; valid: {self.block_names}")
        for name in self.block_names:
            if name not in names:
                self._set_block(name, None)

    # ----- carried state ---------------------------------------------------------------------------
    @contextmanager
    def microbatch_context(self, microbatch: int | None) -> Iterator[None]:
        """Run blocks for ``microbatch`` of the current batch (the pipeline calls this around every stage
        forward; ``None``: a pass whose values do not matter, such as inferring shapes).

        With ``carry_state`` the LSTM layers read and keep the state of this microbatch's rows, for training
        and for evaluation apart; without it nothing changes.
        """
        if not self.hparams.get("carry_state") or microbatch is None:
            yield
            return
        mode = "train" if self.training else "eval"
        layers = [block for _, block in self.blocks() if isinstance(block, _LSTMLayer)]
        for layer in layers:
            layer.slot = (mode, int(microbatch))
        try:
            yield
        finally:
            for layer in layers:
                layer.slot = None

    def reset_state(self, mode: str) -> None:
        """Forget the carried state of ``"train"`` or ``"eval"`` (a new epoch, a new evaluation)."""
        for _, block in self.blocks():
            if isinstance(block, _LSTMLayer):
                for slot in [k for k in block.carried if k[0] == mode]:
                    del block.carried[slot]

    # ----- computation ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Run the present blocks in order (the full model maps token ids to logits)."""
        for _, block in self.blocks():
            x = block(x)
        return x

    def _local_loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = batch[0], batch[1]
        n_tokens = (targets != 0).sum()
        with self.microbatch_context(0):
            loss = token_loss_sum(self(inputs), targets) / n_tokens.clamp(min=1)
        return loss, n_tokens

    def batch_loss(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean token loss of a batch and its number of real tokens.

        In training under a pipeline strategy the backward pass has already run when this returns.
        """
        if self.pipeline is not None:
            return self.pipeline.run(batch, train=self.training and torch.is_grad_enabled())
        return self._local_loss(batch)

    # ----- Lightning hooks ------------------------------------------------------------------------
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss, n_tokens = self.batch_loss(batch)
        size = int(batch[0].shape[0])
        self.log("train/loss", loss, prog_bar=True, batch_size=size)
        now = time.perf_counter()
        if self._last_step_time is not None:
            self.log("train/tokens_per_s", n_tokens.float() / (now - self._last_step_time), on_step=True,
                     on_epoch=True, prog_bar=True, batch_size=size)
        self._last_step_time = now
        return loss

    def on_train_epoch_start(self) -> None:
        self._last_step_time = None
        self.reset_state("train")

    def _eval_step(self, batch: Any, prefix: str) -> torch.Tensor:
        loss, n_tokens = self.batch_loss(batch)
        # Weight each batch by its real tokens so the epoch value is the corpus-level token mean.
        self.log(f"{prefix}/loss", loss, batch_size=int(n_tokens), prog_bar=prefix == "val")
        total, count = self._eval_sums.get(prefix, (0.0, 0))
        self._eval_sums[prefix] = (total + float(loss) * int(n_tokens), count + int(n_tokens))
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self._eval_step(batch, "test")

    def on_validation_epoch_start(self) -> None:
        self._eval_sums.pop("val", None)
        self.reset_state("eval")

    def on_test_epoch_start(self) -> None:
        self._eval_sums.pop("test", None)
        self.reset_state("eval")

    def on_predict_epoch_start(self) -> None:
        self.reset_state("eval")

    def on_validation_epoch_end(self) -> None:
        self._log_perplexity("val")

    def on_test_epoch_end(self) -> None:
        self._log_perplexity("test")

    def _log_perplexity(self, prefix: str) -> None:
        total, count = self._eval_sums.get(prefix, (0.0, 0))
        if count:
            self.log(f"{prefix}/ppl", perplexity(total / count), prog_bar=prefix == "val")

    def predict_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> dict[str, torch.Tensor]:
        """Per-token log-probability of each target and the most likely next token.

        Returns:
            dict with ``log_probs`` (B, T) float, ``next_token`` (B, T) int64 and ``mask`` (B, T) bool
            (True on real tokens).
        """
        if self.pipeline is not None:
            return self.pipeline.predict(batch)
        with self.microbatch_context(0):
            return prediction_from_logits(self(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        name = hp.optimizer.lower()
        # torch's multi-tensor kernels refuse a list that mixes sharded (DTensor) and plain parameters.
        foreach = False if any(isinstance(p, DTensor) for p in params) else None
        if name == "sgd":
            opt = torch.optim.SGD(params, lr=hp.lr, momentum=hp.momentum, weight_decay=hp.weight_decay,
                                  foreach=foreach)
        elif name == "adam":
            opt = torch.optim.Adam(params, lr=hp.lr, weight_decay=hp.weight_decay, foreach=foreach)
        else:
            opt = torch.optim.AdamW(params, lr=hp.lr, weight_decay=hp.weight_decay, foreach=foreach)
        if hp.lr_decay == 1.0:
            return opt
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ExponentialLR(opt, gamma=hp.lr_decay)}


def prediction_from_logits(logits: torch.Tensor, targets: torch.Tensor) -> dict[str, torch.Tensor]:
    """Turn (B, T, V) logits and (B, T) targets into the predict-step dictionary."""
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    target_log_probs = log_probs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    mask = targets != 0
    return {
        "log_probs": target_log_probs.masked_fill(~mask, 0.0),
        "next_token": log_probs.argmax(-1),
        "mask": mask,
    }


def perplexity(loss: float) -> float:
    """``exp(loss)`` guarded against overflow."""
    return math.exp(min(loss, 700.0))

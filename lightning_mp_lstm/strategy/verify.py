"""Check a module's declaration numerically: its own ``training_step`` on one process against the pipeline.

``MPLSTMStrategy(verify=True)`` does this at the first training batch, before training on it: global rank 0 runs the
module's own ``training_step`` (on a whole copy of the module taken before the pipeline split it) twice on the batch,
the second from the state the first carried, recording every random draw by block
(:class:`~lightning_mp_lstm.strategy.random_tape.RandomTape`); every rank then runs the pipeline on the same batch
twice, replaying those draws, so the two sides see the same dropout masks; then the loss, each metric the step logged
and every parameter's gradient are compared, and a table names what differs (and the random draws one side made and the
other did not). A difference stops the run (:class:`VerificationError`) before the first optimizer step; nothing is
changed by a verification that passes (gradients, carried state and random streams are as before).

``python -m lightning_mp_lstm.app.verify package.module:Model --data package.module:DataModule --devices 2`` runs it
from the command line (:mod:`~lightning_mp_lstm.app.verify`; its exit status is 1 when something differs).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_mp_lstm.base import faults
from lightning_mp_lstm.models.batch_layout import rows_first
from lightning_mp_lstm.strategy.random_tape import RandomTape

__all__ = ["Comparison", "VerificationError", "Verifier"]

STEPS = 2  # the second step starts from the state the first carried
#: Relative error allowed between the module's step and the pipeline, by the dtype of what is compared.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-2}


class VerificationError(RuntimeError):
    """The pipeline does not reproduce the module's own training step (the message is the comparison table)."""


@dataclass
class Comparison:
    """The rows of a verification: what was compared, the two values and their relative error."""

    title: str
    rows: list[tuple[str, str, str, str, bool]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(row[-1] for row in self.rows)

    def add(self, what: str, module: Any, pipeline: Any, error: float | None, ok: bool) -> None:
        def shown(value: Any) -> str:
            return f"{value:.6g}" if isinstance(value, float) else "-" if value is None else str(value)
        self.rows.append((what, shown(module), shown(pipeline), "-" if error is None else f"{error:.1e}", ok))

    def table(self) -> str:
        head = ("what", "module's step", "pipeline", "rel. error", "")
        rows = [head] + [(*row[:4], "ok" if row[4] else "DIFFERS") for row in self.rows]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [self.title] + ["  " + "  ".join(r[i].ljust(widths[i]) for i in range(4)) + "  " + r[4] for r in rows]
        verdict = "the pipeline reproduces the module's training step" if self.ok else \
            "the pipeline does NOT reproduce the module's training step"
        return "\n".join([*lines, verdict])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _tolerance(*tensors: torch.Tensor) -> float:
    return max(TOLERANCE.get(t.dtype, 1e-5) for t in tensors)


def _block_of(name: str, blocks: Sequence[str]) -> str:
    """The block a parameter belongs to: by attribute path, or ``rnn.weight_hh_l1`` -> ``rnn.1`` (a multi-layer
    ``nn.LSTM`` split per layer)."""
    for block in sorted(blocks, key=len, reverse=True):
        path, _, layer = block.rpartition(".")
        if name.startswith(block + ".") or (layer.isdigit() and re.fullmatch(
                rf"{re.escape(path)}\.(weight|bias)_(ih|hh)_l{layer}", name)):
            return block
    return "(outside the blocks)"


class Verifier:
    """Runs one verification (see the module docstring).

    Args:
        reference: a whole copy of the user's module (global rank 0 only; ``None`` elsewhere).
        blocks: the pipeline view's block names; ``time_first``: the module's batch layout; ``log_name``: what the
            strategy logs the loss terms under.
        lstm_path: the declared LSTM stack's attribute path (its layers are the blocks between the first and last).
    """

    def __init__(self, reference: nn.Module | None, blocks: Sequence[str], time_first: bool, log_name: str,
                 lstm_path: str) -> None:
        self.reference, self.blocks, self.time_first, self.log_name = reference, list(blocks), time_first, log_name
        self.lstm_path = lstm_path
        self.done = False

    # ----- the module's own step, on global rank 0 -------------------------------------------------------------------
    def _region_hooks(self, module: nn.Module) -> list[Any]:
        """Hooks that tell the tape which block the module's step is in."""
        handles = []
        embedding, *layers, decoder = self.blocks
        stack = module.get_submodule(self.lstm_path)
        if isinstance(stack, nn.ModuleList):
            for name, layer in zip(layers, stack, strict=True):
                handles.append(layer.register_forward_pre_hook(lambda *_, n=name: self._tape.enter(n)))
        else:  # one multi-layer nn.LSTM: what follows it belongs to its last layer
            handles.append(stack.register_forward_pre_hook(lambda *_: self._tape.enter(layers[0])))
            handles.append(stack.register_forward_hook(lambda *_: self._tape.enter(layers[-1])))
        handles.append(module.get_submodule(decoder).register_forward_pre_hook(lambda *_: self._tape.enter(decoder)))
        return handles

    def _reference_steps(self, batch: Any, trainer: Any) -> dict[str, Any]:
        module = self.reference
        assert module is not None
        module.train()
        module._trainer = trainer  # noqa: SLF001  (read by steps that look at the trainer; it logs nothing here)
        rows, length = self._shape(batch)
        logged: list[dict[str, float]] = []
        module.log = lambda name, value, *a, **k: logged[-1].__setitem__(name, _value(value))  # type: ignore
        module.log_dict = lambda values, *a, **k: logged[-1].update({n: _value(v) for n, v in values.items()})
        for parameter in module.parameters():
            parameter.requires_grad_(True)
        hooks = self._region_hooks(module)
        losses, grads, tapes = [], [], []
        try:
            with torch.random.fork_rng(devices=[]):
                for step in range(STEPS):
                    module.zero_grad(set_to_none=True)
                    logged.append({})
                    self._tape = RandomTape(rows, length, self.time_first)
                    self._tape.enter(self.blocks[0])
                    with self._tape:
                        out = module.training_step(batch, step)
                    loss = out["loss"] if isinstance(out, Mapping) else out
                    loss.backward()
                    losses.append(loss.detach().cpu())
                    grads.append({n: p.grad.detach().cpu() for n, p in module.named_parameters(remove_duplicate=False)
                                  if p.grad is not None})
                    tapes.append(self._tape)
        finally:
            for handle in hooks:
                handle.remove()
        return {"losses": losses, "logged": logged, "grads": grads, "draws": [t.draws for t in tapes],
                "names": [n for n, _ in module.named_parameters(remove_duplicate=False)]}

    def _shape(self, batch: Any) -> tuple[int, int]:
        inputs, _ = rows_first(batch[0], batch[1], self.time_first)
        return int(inputs.shape[0]), int(inputs.shape[1])

    # ----- the pipeline, on every rank ----------------------------------------------------------------------------
    def run(self, engine: Any, module: nn.Module, batch: Any, trainer: Any, title: str,
            context: Callable[[], Any] = nullcontext) -> Comparison:
        """Verify on ``batch`` (the first training batch, as this rank was given it); every rank returns the same
        comparison (a collective).

        Args:
            engine: the strategy's pipeline engine; ``module``: the (pruned) module it trains.
            trainer: attached to the reference copy while its step runs.
            title: the table's first line.
            context: the precision plugin's training-step context (autocast), around both sides' steps.
        """
        self.done = True
        whole = self._whole_batch(engine, batch)
        with context():
            reference = faults.result_from(0, lambda: self._reference_steps(whole, trainer))
        rows, length = self._shape(whole)
        offset = self._replica_offset(engine, batch)
        kernel_dropout = getattr(engine.model, "kernel_dropout", None)
        kernel_rate = kernel_dropout.p if kernel_dropout is not None else 0.0
        if kernel_dropout is not None:  # drawn inside torch's multi-layer kernel by the module: not recordable
            kernel_dropout.p = 0.0
        parameters = dict(module.named_parameters(remove_duplicate=False))
        saved = {name: p.grad for name, p in parameters.items()}
        losses, terms, grads, notes = [], [], [], []
        for step in range(STEPS):
            for p in parameters.values():
                p.grad = None
            tape = RandomTape(rows, length, self.time_first)
            tape.draws = reference["draws"][step]
            tape.replay()
            hooks = self._piece_hooks(engine, tape, offset)
            try:
                with tape, context():
                    result = engine.forward_backward(batch)
            finally:
                for handle in hooks:
                    handle.remove()
            engine.reduce_gradients(list(module.parameters()))
            losses.append(result.loss.detach().cpu())
            terms.append({n: v.detach().cpu() for n, v in result.terms.items()})
            grads.append({n: p.grad.detach().cpu() for n, p in parameters.items() if p.grad is not None})
            notes.append(tape.mismatches + [f"block {b}: the module's own step draws {k} random tensor(s) the "
                                            "pipeline never draws (a random part it does not reproduce)"
                                            for b, k in sorted(tape.unused().items())])
        for name, p in parameters.items():
            p.grad = saved[name]
        engine.reset_state("train")
        if kernel_dropout is not None:
            kernel_dropout.p = kernel_rate
            notes[0].append(f"note: the multi-layer nn.LSTM's own dropout ({kernel_rate}) is drawn inside torch's "
                            "kernel, so both sides ran it at rate 0 here")
        every = faults.gather(lambda: {"grads": grads, "notes": notes})
        comparison = Comparison(title)
        if not dist.is_initialized() or dist.get_rank() == 0:
            comparison = self._compare(title, reference, losses, terms, every)
        return faults.result_from(0, lambda: comparison)

    def _whole_batch(self, engine: Any, batch: Any) -> Any:
        """The batch the module's own step sees: every replica's share when the data gives each replica its own."""
        if engine.global_batches or engine.layout.data_parallel_size == 1:
            return batch
        shares = faults.gather(lambda: rows_first(batch[0], batch[1], self.time_first))
        leads = [engine.layout.global_rank(replica, 0) for replica in range(engine.layout.data_parallel_size)]
        inputs = torch.cat([shares[r][0] for r in leads]).to(batch[0].device)
        targets = torch.cat([shares[r][1] for r in leads]).to(batch[1].device)
        if not self.time_first:
            return (inputs, targets.view(inputs.shape) if batch[1].dim() == 2 else targets)
        flat = batch[1].dim() == 1
        return (inputs.t().contiguous(), targets.t().contiguous().view(-1) if flat else targets.t().contiguous())

    def _replica_offset(self, engine: Any, batch: Any) -> int:
        """The first row of this replica's share in the whole batch."""
        replicas = engine.layout.data_parallel_size
        if replicas == 1:
            return 0
        if engine.global_batches:
            rows = [int(t.shape[0]) for t in rows_first(batch[0], batch[1], self.time_first)[0].tensor_split(replicas)]
        else:
            every = faults.gather(lambda: self._shape(batch)[0])
            rows = [every[engine.layout.global_rank(replica, 0)] for replica in range(replicas)]
        return sum(rows[:engine.data_parallel_rank])

    def _piece_hooks(self, engine: Any, tape: RandomTape, offset: int) -> list[Any]:
        """Hooks on every block of this process's stages: the tape replays the draws of that block, cut to the rows
        (and time steps) of the piece the stage runs."""
        handles = []
        for stage in engine.stage_modules.values():
            for name, block in zip(stage.block_names, stage.blocks):
                def enter(_: nn.Module, args: tuple, name: str = name, stage: Any = stage) -> None:
                    if stage.inferring_shapes:  # torch's shape inference runs the stage once more: not a piece
                        tape.enter(None)
                        return
                    x = args[0]
                    microbatch = stage.microbatch or 0
                    piece = (offset + microbatch * int(x.shape[0]), int(x.shape[0]), stage.time_start,
                             int(x.shape[1]))
                    tape.piece = lambda piece=piece: piece
                    tape.enter(name, (microbatch, stage.time_start))
                handles.append(block.register_forward_pre_hook(enter))
        return handles

    # ----- the table --------------------------------------------------------------------------------------------
    def _compare(self, title: str, reference: dict[str, Any], losses: list, terms: list, every: list) -> Comparison:
        comparison = Comparison(title)
        for step in range(STEPS):
            expected, got = reference["losses"][step], losses[step]
            error = _relative(got, expected)
            comparison.add(f"step {step} loss", float(expected), float(got), error, error <= _tolerance(expected))
            logged = reference["logged"][step]
            produced = {self.log_name.format(split="train", metric="loss"): got}
            produced |= {self.log_name.format(split="train", metric=n): v for n, v in terms[step].items()}
            for name, value in sorted(logged.items()):
                if name in produced:
                    error = _relative(produced[name], torch.tensor(value, dtype=torch.float64))
                    comparison.add(f"step {step} metric {name}", value, float(produced[name]), error,
                                   error <= _tolerance(expected))
                else:
                    comparison.add(f"step {step} metric {name}", value, "not logged", None, False)
            self._compare_grads(comparison, step, reference, [rank["grads"][step] for rank in every])
        for note in sorted({n for rank in every for step_notes in rank["notes"] for n in step_notes}):
            comparison.add(note, "-", "-", None, False)
        return comparison

    def _compare_grads(self, comparison: Comparison, step: int, reference: dict[str, Any],
                       per_rank: list[dict[str, torch.Tensor]]) -> None:
        expected = reference["grads"][step]
        worst: dict[str, tuple[float, float, list[str]]] = {}
        for name in reference["names"]:
            block = _block_of(name, self.blocks)
            copies = [grads[name] for grads in per_rank if name in grads]
            tolerance = _tolerance(*copies, expected[name]) if name in expected and copies else 1e-5
            if name in expected and not copies:
                error = float("inf")
            elif copies:
                error = max(_relative(c, expected[name]) if name in expected else float(c.norm() > 0) for c in copies)
            else:
                continue
            best, tol, bad = worst.get(block, (0.0, tolerance, []))
            worst[block] = (max(best, error), tol, bad + ([name] if error > tolerance else []))
        for block in [b for b in self.blocks if b in worst] + sorted(set(worst) - set(self.blocks)):
            error, _, bad = worst[block]
            what = f"step {step} gradients of {block}" + (f" ({', '.join(bad)})" if bad else "")
            comparison.add(what, None, "no gradient" if error == float("inf") else None,
                           None if error == float("inf") else error, not bad)


def _value(value: Any) -> float:
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)

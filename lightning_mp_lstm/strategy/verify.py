"""Check a module's declaration numerically: its own ``training_step`` on one process against the pipeline.

``MPLSTMStrategy`` does this by default (``verify="auto"``) at the first training batch, before training on it,
whenever global rank 0 holds the whole module: global rank 0 runs the module's own ``training_step`` twice on the
batch, on the module itself made whole again (:class:`~lightning_mp_lstm.strategy.whole_module.WholeModule`: no copy),
the second step from the state the first carried, recording every random draw by block
(:class:`~lightning_mp_lstm.strategy.random_tape.RandomTape`); every rank then runs the pipeline on the same batch
twice, replaying those draws, so the two sides see the same dropout masks; then the loss, every metric the step logged
and every parameter's gradient are compared, and a table names what differs (and the random draws one side made and the
other did not). A metric the module logs under a name is compared with what the pipeline would log under it; when it
is another quantity the pipeline has (the declared loss without the penalty, or per target token), the pipeline logs
that quantity under the module's name from then on (:attr:`Comparison.names`), else it differs. A difference stops the
run (:class:`VerificationError`) before the first optimizer step; nothing is changed by a verification that passes
(the module's attributes, gradients, carried state and random streams are as before).

``python -m lightning_mp_lstm.app.verify package.module:Model --data package.module:DataModule --devices 2`` runs it
from the command line (:mod:`~lightning_mp_lstm.app.verify`; its exit status is 1 when something differs).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torchmetrics import Metric

from lightning_mp_lstm.base import faults
from lightning_mp_lstm.models.batch_layout import rows_first
from lightning_mp_lstm.models.metrics import SPEED_METRICS, train_quantities
from lightning_mp_lstm.strategy.precision import exact_numerics
from lightning_mp_lstm.strategy.random_tape import RandomTape
from lightning_mp_lstm.strategy.whole_module import WholeModule

__all__ = ["Comparison", "VerificationError", "Verifier"]

STEPS = 2  # the second step starts from the state the first carried
#: Quantities the pipeline logs only under a module's own name for them (never under its own).
UNLOGGED = ("declared_loss", "ppl")
#: Relative error allowed between the module's step and the pipeline, by the dtype of what is compared.
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-2}


class VerificationError(RuntimeError):
    """The pipeline does not reproduce the module's own training step (the message is the comparison table)."""


@dataclass
class Comparison:
    """The rows of a verification: what was compared, the two values and their relative error."""

    title: str
    rows: list[tuple[str, str, str, str, bool]] = field(default_factory=list)
    #: What is true of the module's step and the pipeline without being a difference.
    notes: list[str] = field(default_factory=list)
    #: The pipeline's quantity (``loss``, ``loss_per_token``, ``declared_loss``, ``ppl``, a term) -> the names the
    #: module logs it under.
    names: dict[str, list[str]] = field(default_factory=dict)
    #: The ``on_step`` / ``on_epoch`` each metric was logged with by the module's step.
    flags: dict[str, dict[str, bool]] = field(default_factory=dict)

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
        return "\n".join([*lines, *(f"note: {note}" for note in self.notes), verdict])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _tolerance(*tensors: torch.Tensor, floor: float = 0.0) -> float:
    return max(floor, *(TOLERANCE.get(t.dtype, 1e-5) for t in tensors))


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
        whole: global rank 0's hold on the blocks pruning removes (``None`` elsewhere).
        blocks: the pipeline view's block names; ``time_first``: the module's batch layout; ``log_name``: what the
            strategy logs the loss terms under; ``reduction``: the declared loss's.
        lstm_path: the declared LSTM stack's attribute path (its layers are the blocks between the first and last).
    """

    def __init__(self, whole: WholeModule | None, blocks: Sequence[str], time_first: bool, log_name: str,
                 lstm_path: str, reduction: str = "token_mean") -> None:
        self.whole, self.blocks, self.time_first, self.log_name = whole, list(blocks), time_first, log_name
        self.lstm_path, self.reduction = lstm_path, reduction
        self.done = False
        self.floor = 0.0  # the least relative error allowed (autocast's dtype's, under mixed precision)

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

    def _reference_steps(self, module: nn.Module, batch: Any, trainer: Any, device: torch.device,
                         convert: Callable[[nn.Module], Any],
                         values: list[tuple[dict[str, torch.Tensor], list[str], list[str]]]) -> dict[str, Any]:
        """The module's own ``training_step``, :data:`STEPS` times, on ``module`` made whole (restored after) with
        every process's current parameter ``values`` and the user's choices the pipeline keeps too: in training mode
        but the modules a process holds in eval mode, every parameter requiring its gradient but those a process
        holds frozen."""
        assert self.whole is not None
        rows, length = self._shape(batch)
        logged: list[dict[str, float]] = []
        flags: dict[str, dict[str, bool]] = {}

        def log(name: str, value: Any, *_: Any, **options: Any) -> None:
            number = _value(value)
            if number is not None:
                logged[-1][name] = number
            flags[name] = {k: bool(options[k]) for k in ("on_step", "on_epoch") if options.get(k) is not None}

        losses, grads, tapes, extra = [], [], [], set()
        with self.whole.attached(module, device, convert) as whole, _forked(device):
            self.whole.take_values(whole, [parameters for parameters, _, _ in values])
            whole.train()
            parts = dict(whole.named_modules())
            for name in {name for _, in_eval, _ in values for name in in_eval} & set(parts):
                parts[name].training = False
            whole._trainer = trainer  # noqa: SLF001  (read by steps that look at the trainer; it logs nothing here)
            whole.log = log  # type: ignore[method-assign]
            whole.log_dict = lambda values, *a, **k: [log(n, v, *a, **k) for n, v in values.items()]  # type: ignore
            frozen = {name for _, _, names in values for name in names}
            for name, parameter in whole.named_parameters(remove_duplicate=False):
                parameter.requires_grad_(name not in frozen)
            hooks = self._region_hooks(whole)
            try:
                for step in range(STEPS):
                    whole.zero_grad(set_to_none=True)
                    logged.append({})
                    self._tape = RandomTape(rows, length, self.time_first)
                    self._tape.enter(self.blocks[0])
                    try:
                        with self._tape:
                            out = whole.training_step(batch, step)
                        if isinstance(out, Mapping):
                            extra |= {str(k) for k in out if k != "loss"}
                        loss = out["loss"] if isinstance(out, Mapping) else out
                        loss.backward()
                    except Exception as error:
                        raise VerificationError(
                            f"the numerical check of the declaration runs {type(whole).__name__}.training_step on "
                            f"the first training batch on global rank 0 (step {step} of {STEPS}), and it raised "
                            f"{type(error).__name__}: {error}. Fix the step, or skip the check with "
                            "MPLSTMStrategy(verify=False)") from error
                    losses.append(loss.detach().cpu())
                    named = list(whole.named_parameters(remove_duplicate=False))
                    grads.append({n: p.grad.detach().cpu() for n, p in named if p.grad is not None})
                    tapes.append(self._tape)
            finally:
                for handle in hooks:
                    handle.remove()
            groups: dict[int, list[str]] = {}
            for name, parameter in whole.named_parameters(remove_duplicate=False):
                groups.setdefault(id(parameter), []).append(name)
        return {"losses": losses, "logged": logged, "flags": flags, "grads": grads, "draws": [t.draws for t in tapes],
                "groups": list(groups.values()), "extra": sorted(extra)}

    def _shape(self, batch: Any) -> tuple[int, int]:
        inputs, _ = rows_first(batch[0], batch[1], self.time_first)
        return int(inputs.shape[0]), int(inputs.shape[1])

    # ----- the pipeline, on every rank ----------------------------------------------------------------------------
    def run(self, engine: Any, module: nn.Module, batch: Any, trainer: Any, title: str, device: torch.device,
            convert: Callable[[nn.Module], Any], context: Callable[[], Any] = nullcontext) -> Comparison:
        """Verify on ``batch`` (the first training batch, as this rank was given it); every rank returns the same
        comparison (a collective). Global rank 0 lets go of the whole module's blocks afterwards.

        Args:
            engine: the strategy's pipeline engine; ``module``: the (pruned) module it trains.
            trainer: attached to the module while its own step runs.
            title: the table's first line.
            device, convert: where global rank 0 runs the module's own step, and the precision plugin's
                ``convert_module`` for the blocks it does not train.
            context: the precision plugin's training-step context (autocast), around both sides' steps.
        """
        self.done = True
        with exact_numerics():
            return self._run(engine, module, batch, trainer, title, device, convert, context)

    def _run(self, engine: Any, module: nn.Module, batch: Any, trainer: Any, title: str, device: torch.device,
             convert: Callable[[nn.Module], Any], context: Callable[[], Any]) -> Comparison:
        whole = self._whole_batch(engine, batch)
        values = _gather_on_rank_zero(module)
        try:
            with context():
                if torch.is_autocast_enabled(device.type):  # both sides' products rounded to it: its tolerance
                    self.floor = TOLERANCE.get(torch.get_autocast_dtype(device.type), self.floor)
                reference = faults.result_from(0, lambda: self._reference_steps(module, whole, trainer, device,
                                                                                convert, values))
        finally:
            self.whole = None  # the blocks other processes train are not needed here any more
        rows, length = self._shape(whole)
        offset = self._replica_offset(engine, batch)
        kernel_dropout = getattr(engine.model, "kernel_dropout", None)
        kernel_rate = kernel_dropout.p if kernel_dropout is not None else 0.0
        if kernel_dropout is not None:  # drawn inside torch's multi-layer kernel by the module: not recordable
            kernel_dropout.p = 0.0
        saved = {p: p.grad for p in module.parameters()}
        losses, quantities, grads, notes = [], [], [], []
        with _forked(device):
            for step in range(STEPS):
                for p in saved:
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
                quantities.append({n: v.detach().cpu() for n, v in train_quantities(
                    result.loss, result.terms, result.weights, self.reduction).items()})
                named = module.named_parameters(remove_duplicate=False)  # after a forward: aliases it made too
                grads.append({n: _whole(p.grad) for n, p in named if p.grad is not None})
                notes.append(tape.mismatches + [f"block {b}: the module's own step draws {k} random tensor(s) the "
                                                "pipeline never draws (a random part it does not reproduce)"
                                                for b, k in sorted(tape.unused().items())])
        for p, grad in saved.items():
            p.grad = grad
        engine.reset_state("train")
        if kernel_dropout is not None:
            kernel_dropout.p = kernel_rate
        every = faults.gather(lambda: {"grads": grads, "notes": notes})
        comparison = Comparison(title)
        if not dist.is_initialized() or dist.get_rank() == 0:
            comparison = self._compare(title, reference, losses, quantities, every)
            if kernel_rate:
                comparison.notes.append(f"the multi-layer nn.LSTM's own dropout ({kernel_rate}) is drawn inside "
                                        "torch's kernel, where it cannot be replayed: both sides ran it at rate 0 "
                                        "here, and train with it")
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
    def _compare(self, title: str, reference: dict[str, Any], losses: list, quantities: list,
                 every: list) -> Comparison:
        comparison = Comparison(title, flags=reference["flags"])
        for step in range(STEPS):
            expected, got = reference["losses"][step], losses[step]
            error = _relative(got, expected)
            comparison.add(f"step {step} loss", float(expected), float(got), error,
                           error <= _tolerance(expected, floor=self.floor))
            self._compare_grads(comparison, step, reference, [rank["grads"][step] for rank in every])
        self._compare_metrics(comparison, reference["logged"], quantities)
        for note in sorted({n for rank in every for step_notes in rank["notes"] for n in step_notes}):
            comparison.add(note, "-", "-", None, False)
        if reference["extra"]:
            comparison.notes.append(f"training_step returns {', '.join(map(repr, reference['extra']))} beside 'loss', "
                                    "which Lightning hands to on_train_batch_end as outputs: the pipeline's outputs "
                                    "hold the loss alone")
        return comparison

    def _compare_metrics(self, comparison: Comparison, logged: list[dict[str, float]], quantities: list) -> None:
        """Each metric the module's step logged against what the pipeline logs under its name, or else against
        another quantity the pipeline has (then logged under the module's name)."""
        own = {self.log_name.format(split="train", metric=q): q for q in quantities[0]}
        speed = {self.log_name.format(split="train", metric=m) for m in SPEED_METRICS}  # the strategy logs its own
        for name in sorted({n for step in logged for n in step} - speed):
            def agrees(quantity: str) -> list[tuple[float, float, float]] | None:
                found = []
                for step in range(STEPS):
                    if name not in logged[step] or quantity not in quantities[step]:
                        return None
                    value, got = logged[step][name], quantities[step][quantity]
                    error = _relative(got, torch.tensor(value, dtype=torch.float64))
                    if error > _tolerance(got.float(), floor=self.floor):
                        return None
                    found.append((value, float(got), error))
                return found

            match = own.get(name) if own.get(name) and agrees(own[name]) else next(
                (q for q in quantities[0] if agrees(q)), None)
            if match is None and own.get(name) in (None, *UNLOGGED):
                logs = ", ".join(sorted(n for n, q in own.items() if q not in UNLOGGED))
                comparison.notes.append(f"metric {name!r}, which training_step logs, is not logged under mp_lstm (it "
                                        f"logs {logs}): log it from a hook or callback")
                continue
            if match is None:
                for step in range(STEPS):
                    value, got = logged[step].get(name), quantities[step].get(own[name])
                    error = None if value is None or got is None else _relative(got, torch.tensor(value))
                    comparison.add(f"step {step} metric {name}", value, "-" if got is None else float(got), error,
                                   error is not None and error <= _tolerance(got.float(), floor=self.floor))
                continue
            for step, (value, got, error) in enumerate(agrees(match) or []):
                what = f"step {step} metric {name}" + ("" if own.get(name) == match else f" (the pipeline's {match})")
                comparison.add(what, value, got, error, True)
            comparison.names.setdefault(match, []).append(name)

    def _compare_grads(self, comparison: Comparison, step: int, reference: dict[str, Any],
                       per_rank: list[dict[str, torch.Tensor]]) -> None:
        """Every parameter's gradient, once per parameter under any of its names (a tied weight or an alias a
        wrapper makes, such as a weight-dropped LSTM's raw weight at rate 0, is one parameter)."""
        expected = reference["grads"][step]
        worst: dict[str, tuple[float, float, list[str]]] = {}
        for names in reference["groups"]:
            name = names[0]
            wanted = next((expected[n] for n in names if n in expected), None)
            copies = [next(grads[n] for n in names if n in grads) for grads in per_rank
                      if any(n in grads for n in names)]
            block = _block_of(name, self.blocks)
            tolerance = _tolerance(*copies, wanted, floor=self.floor) if wanted is not None and copies else 1e-5
            if wanted is not None and not copies:
                error = float("inf")
            elif copies:
                error = max(_relative(c, wanted) if wanted is not None else float(c.norm() > 0) for c in copies)
            else:
                continue
            best, tol, bad = worst.get(block, (0.0, tolerance, []))
            worst[block] = (max(best, error), tol, bad + ([name] if error > tolerance else []))
        for block in [b for b in self.blocks if b in worst] + sorted(set(worst) - set(self.blocks)):
            error, _, bad = worst[block]
            what = f"step {step} gradients of {block}" + (f" ({', '.join(bad)})" if bad else "")
            comparison.add(what, None, "no gradient" if error == float("inf") else None,
                           None if error == float("inf") else error, not bad)


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    """A detached CPU copy, whole (a tensor-parallel shard gathered over its group: every shard's rank calls it)."""
    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().cpu()


def _gather_on_rank_zero(module: nn.Module) -> list[tuple[dict[str, torch.Tensor], list[str], list[str]]]:
    """Every process's parameters by name (a tensor-parallel shard whole), the names of its modules in eval mode and
    of its parameters that do not require gradients (the user's choices), on global rank 0 (empty elsewhere)."""
    values = ({name: _whole(p) for name, p in module.named_parameters()},
              [name for name, part in module.named_modules() if not part.training],
              [name for name, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad])
    if not dist.is_initialized():
        return [values]
    every: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(values, every, dst=0, group=faults.object_group())
    return every or []


@contextmanager
def _forked(device: torch.device) -> Iterator[None]:
    """The random streams (the CPU's and ``device``'s) as they were before."""
    accelerator = {} if device.type == "cpu" else {"devices": [device], "device_type": device.type}
    with torch.random.fork_rng(**({"devices": []} | accelerator)):
        yield


def _value(value: Any) -> float | None:
    """A logged value as a number. A torchmetrics metric is what Lightning logs on step for it, its last forward's
    value (``None``: it has none, e.g. a metric only updated, for its epoch's value)."""
    if isinstance(value, Metric):
        value = value._forward_cache  # noqa: SLF001  (Lightning's ``_ResultMetric`` reads the same)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            return None
    return float(value.detach()) if isinstance(value, torch.Tensor) else float(value)

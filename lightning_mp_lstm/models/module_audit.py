"""What the structure of a module proves the pipeline would not reproduce, named before training.

Under ``mp_lstm`` the strategy runs the pieces a module declares
(:class:`~lightning_mp_lstm.models.declaration.LSTMBlocks`: its blocks, its ``embed`` / ``after_lstm`` / ``loss`` /
``penalty`` methods) instead of its ``training_step``. Some differences follow from how the module is built, whatever
its step computes, and are named here without running anything: parameters outside the declared blocks (they would
never be trained: :func:`parameters_outside`, which stops the run), a ``backward`` of the module's own (the schedule
runs the backward pass, so it is never called) and, on a split model, a clip or a norm measured in the module's
gradient hooks (each process would clip by, or measure, its own part). Manual optimization is refused by
:func:`~lightning_mp_lstm.strategy.pipeline_setup.check_automatic_optimization`.

The body of ``training_step`` is not read for what it computes: reading source cannot prove that the declared pieces
add up to it (a value computed at run time, a loss kept in ``self.criterion``, a model built in a submodule of the
module's own are invisible to it, and guessing from patterns warned about correct modules and missed wrong ones).
The numerical check does prove it: :mod:`~lightning_mp_lstm.strategy.verify` runs the module's own ``training_step``
and the pipeline on the first training batch and names every loss, metric and gradient that differs.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from torch import nn

__all__ = ["Finding", "NotReproducedWarning", "audit", "parameters_outside", "render_findings"]

#: Calls that clip by the norm of the gradients they are given: under a split model, this process's part's.
NORM_CLIPS = frozenset({"clip_grad_norm_", "clip_grad_norm", "clip_grads_with_norm_"})
#: Calls that measure the norm of the gradients they are given (Lightning's ``grad_norm`` logs a total).
NORM_READS = frozenset({"grad_norm", "get_total_norm"})
#: The module's hooks that may change gradients before the optimizer steps.
GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step")
DOCS_PAGE = "docs/bring_your_own_model.md"


class NotReproducedWarning(UserWarning):
    """The module's structure shows something its pipeline declaration does not reproduce."""


@dataclass(frozen=True)
class Finding:
    """One thing the module does that the pipeline would not.

    Attributes:
        what: what is not reproduced, with where the source says it.
        fix: what to declare (or change) so that it is.
    """

    what: str
    fix: str


def _base_method(cls: type, name: str) -> bool:
    """Whether ``cls.name`` is Lightning's or torch's own (not the user's code)."""
    function = getattr(cls, name, None)
    module = getattr(function, "__module__", "") or ""
    return module.startswith(("lightning", "torch", "pytorch_lightning"))


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _read_calls(cls: type, names: Iterable[str]) -> dict[str, str]:
    """The calls made by the methods ``names`` of ``cls`` and by every method of ``cls`` they call on ``self``
    (``self(...)`` is ``forward``): the called name (``F.dropout`` -> ``dropout``) -> where (``"method, line N"``)."""
    calls: dict[str, str] = {}
    pending, seen = list(names), set()
    while pending:
        name = pending.pop(0)
        if name in seen or not callable(getattr(cls, name, None)) or _base_method(cls, name):
            continue
        seen.add(name)
        function = getattr(cls, name)
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
        except (OSError, TypeError, SyntaxError, IndentationError):
            continue  # nothing to name from it; the numerical check runs it
        code = getattr(function, "__code__", None)
        offset = code.co_firstlineno - 1 if code is not None else 0
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            called = _call_name(node.func)
            if called is not None:
                calls.setdefault(called, f"{name}, line {node.lineno + offset}")
            if isinstance(node.func, ast.Name) and node.func.id == "self":
                pending.append("forward")
            elif isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
                    and node.func.value.id == "self" and node.func.attr not in ("log", "log_dict"):
                pending.append(node.func.attr)
    return calls


def parameters_outside(module: nn.Module, block_paths: Iterable[str]) -> list[str]:
    """Names of ``module``'s parameters that no declared block holds (they would never be trained)."""
    paths = tuple(f"{path}." for path in block_paths)
    return [name for name, _ in module.named_parameters() if not name.startswith(paths)]


def audit(module: nn.Module, declaration: Any = None, split: bool = False) -> list[Finding]:
    """What ``module`` 's structure shows the pipeline would not reproduce: a ``backward`` of its own and, on a split
    model, a clip or a norm measured in its gradient hooks. Everything its ``training_step`` computes is the
    numerical check's (:mod:`~lightning_mp_lstm.strategy.verify`).

    Args:
        module: the user's module (whole, before pruning).
        declaration: its :class:`~lightning_mp_lstm.models.declaration.LSTMBlocks` (what the pipeline runs; nothing
            found here depends on it).
        split: each process holds part of the model (pipeline or tensor parallel): a hook that clips by the norm of
            ``self.parameters()`` clips by a part's.
    """
    cls = type(module)
    return (_clip_findings(cls) if split else []) + _backward_findings(cls)


def _clip_findings(cls: type) -> list[Finding]:
    """A clip or a measure by norm in the module's gradient hooks: each process would clip by, or log, its own part's
    norm."""
    calls = sorted(_read_calls(cls, GRADIENT_HOOKS).items())
    fix = ("clip with Trainer(gradient_clip_val=...), which the strategy applies with the whole model's norm (in "
           "configure_gradient_clipping: self.clip_gradients(optimizer, gradient_clip_val=..., "
           "gradient_clip_algorithm='norm'))")
    reads = ("to log the whole model's norm, sum the parts' squared norms over the pipeline (and tensor-parallel) "
             "group first: trainer.strategy.device_mesh['pipeline_parallel'].get_group()")
    return [Finding(f"{call}(...) in {where} clips by the norm of this process's part of the model, not of the "
                    "whole model", fix)
            for call, where in calls if call in NORM_CLIPS] + [
            Finding(f"{call}(...) in {where} measures this process's part of the model: a total norm it gives is not "
                    "the whole model's, and Lightning's loggers write global rank 0's part only", reads)
            for call, where in calls if call in NORM_READS]


def _backward_findings(cls: type) -> list[Finding]:
    """A ``backward`` of the module's own: the schedule runs the backward pass, and Lightning's call of
    ``LightningModule.backward`` only adds the gradients it computed."""
    if not callable(getattr(cls, "backward", None)) or _base_method(cls, "backward"):
        return []
    code = getattr(cls.backward, "__code__", None)
    where = f"backward, line {code.co_firstlineno}" if code is not None else "backward"
    return [Finding(f"{cls.__name__}.backward ({where}) is not called: the pipeline runs the backward pass in its "
                    "schedule", "put what it adds to the loss in a method the declaration names (loss=..., "
                    "penalty=...), and what it does to the gradients in on_after_backward")]


def render_findings(module_name: str, findings: list[Finding]) -> str:
    """One message naming every finding and its fix."""
    lines = [f"mp_lstm runs the pieces {module_name} declares in configure_pipeline() in place of "
             f"{module_name}.training_step, and its hooks on each process's part of the model; they do not reproduce "
             "all of it:"]
    lines += [f"  - {f.what}: {f.fix}" for f in findings]
    lines.append("Everything else is checked numerically at the first training batch: MPLSTMStrategy(verify=...), "
                 "on by default when global rank 0 holds the whole module, runs its own training_step against the "
                 f"pipeline and names what differs (see {DOCS_PAGE}).")
    return "\n".join(lines)

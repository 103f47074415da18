"""What a module's own training step does that its pipeline declaration would not reproduce, read from its source.

Under ``mp_lstm`` the strategy runs the pieces a module declares
(:class:`~lightning_mp_lstm.models.declaration.LSTMBlocks`: its blocks, its ``embed`` / ``after_lstm`` / ``loss`` /
``penalty`` methods) instead of its ``training_step``. This module reads the module's ``training_step`` (and every
method of the module it calls, ``forward`` through ``self(...)`` included) and the declared methods with :mod:`ast`, and
names what the step does that the pieces do not: a submodule the step uses and no piece does (a locked dropout, a
metric), a random draw (``embedded_dropout``, ``F.dropout``), a metric it logs that the strategy will not log, state it
keeps across batches without ``carry_state``, a loss reduction or ``ignore_index`` other than the declared one, an
exception it raises (a check the pipeline would never make), and parameters outside the blocks; of the module's
``validation_step`` and ``test_step``, a metric they log that the pipeline's evaluation does not; on a split model,
a clip by norm in a gradient hook. It reads source only: it runs nothing and cannot see what a computed value is;
the numerical check is ``MPLSTMStrategy(verify=True)`` (:mod:`~lightning_mp_lstm.strategy.verify`).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

__all__ = ["Finding", "NotReproducedWarning", "StepSource", "audit", "parameters_outside", "read_methods",
           "render_findings", "training_log_flags"]

#: Calls that draw random numbers (the last name of the called expression).
RANDOM_CALLS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                          "bernoulli", "bernoulli_", "rand", "rand_like", "randn", "randn_like", "randint",
                          "randperm", "normal_", "uniform_", "embedded_dropout"})
#: Loss functions whose ``reduction`` / ``ignore_index`` keywords the audit compares with the declaration.
LOSS_CALLS = frozenset({"cross_entropy", "nll_loss", "CrossEntropyLoss", "NLLLoss"})
_REDUCTION_OF = {"mean": "token_mean", "sum": "sum"}
#: Calls that clip by the norm of the gradients they are given: under a split model, this process's part's.
NORM_CLIPS = frozenset({"clip_grad_norm_", "clip_grad_norm", "clip_grads_with_norm_"})
#: Calls that measure the norm of the gradients they are given (Lightning's ``grad_norm`` logs a total).
NORM_READS = frozenset({"grad_norm", "get_total_norm"})
#: The module's hooks that may change gradients before the optimizer steps.
GRADIENT_HOOKS = ("on_after_backward", "on_before_optimizer_step", "configure_gradient_clipping", "optimizer_step")
DOCS_PAGE = "docs/bring_your_own_model.md"


class NotReproducedWarning(UserWarning):
    """The module's training step does something its pipeline declaration does not reproduce."""


@dataclass(frozen=True)
class Finding:
    """One thing the module's step does that the pipeline would not.

    Attributes:
        what: what is not reproduced, with where the source says it.
        fix: what to declare (or change) so that it is.
    """

    what: str
    fix: str


@dataclass
class StepSource:
    """What some methods of a module do, read from their source (the methods they call on ``self`` included).

    Attributes:
        attributes: ``self.<name>`` read anywhere -> where (``"method, line N"``).
        calls: names of called functions and methods (the last name: ``F.dropout`` -> ``dropout``) -> where.
        logged: metric names given to ``self.log`` / ``self.log_dict`` as literals -> where; ``"?"`` for a computed
            name.
        carried: ``self.<name>`` both assigned and passed to a call of the module (``self(...)``, ``self.forward``)
            -> where: state kept across batches.
        keywords: ``(call, keyword)`` -> literal value, for the loss calls.
        returned_keys: the literal keys of the dicts the methods return.
        log_flags: for a metric logged under a literal name, the literal ``on_step`` / ``on_epoch`` it is logged with.
        raised: exceptions raised by name (``raise ValueError(...)`` -> ``ValueError``) -> where.
        unread: methods whose source could not be read.
    """

    attributes: dict[str, str] = field(default_factory=dict)
    calls: dict[str, str] = field(default_factory=dict)
    logged: dict[str, str] = field(default_factory=dict)
    carried: dict[str, str] = field(default_factory=dict)
    keywords: dict[tuple[str, str], Any] = field(default_factory=dict)
    returned_keys: set[str] = field(default_factory=set)
    log_flags: dict[str, dict[str, bool]] = field(default_factory=dict)
    raised: dict[str, str] = field(default_factory=dict)
    unread: list[str] = field(default_factory=list)


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


def _self_attribute(node: ast.AST) -> str | None:
    """``name`` of ``self.name`` (the first attribute of ``self.name.more``)."""
    while isinstance(node, ast.Attribute):
        if isinstance(node.value, ast.Name) and node.value.id == "self":
            return node.attr
        node = node.value
    return None


def read_methods(cls: type, names: Iterable[str]) -> StepSource:
    """Read the methods ``names`` of ``cls`` and every method of ``cls`` they call on ``self``."""
    found = StepSource()
    pending, seen = list(names), set()
    while pending:
        name = pending.pop(0)
        if name in seen or not callable(getattr(cls, name, None)) or _base_method(cls, name):
            continue
        seen.add(name)
        try:
            source = textwrap.dedent(inspect.getsource(getattr(cls, name)))
            tree = ast.parse(source)
        except (OSError, TypeError, SyntaxError, IndentationError):
            found.unread.append(name)
            continue
        first = getattr(getattr(cls, name), "__code__", None)
        offset = (first.co_firstlineno - 1) if first is not None else 0
        pending.extend(_read(tree, name, offset, found))
    return found


def _read(tree: ast.AST, method: str, offset: int, found: StepSource) -> list[str]:
    """Collect into ``found`` what ``tree`` (the source of ``method``) does; return the ``self`` methods it calls."""
    callees: list[str] = []
    assigned: dict[str, int] = {}
    passed: set[str] = set()

    def where(node: ast.AST) -> str:
        return f"{method}, line {getattr(node, 'lineno', 0) + offset}"

    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Load):
            name = _self_attribute(node)
            if name is not None:
                found.attributes.setdefault(name, where(node))
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                for part in ast.walk(target):
                    if isinstance(part, ast.Attribute) and isinstance(part.value, ast.Name) and part.value.id == "self":
                        assigned.setdefault(part.attr, getattr(node, "lineno", 0))
        elif isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
            found.returned_keys.update(str(k.value) for k in node.value.keys if isinstance(k, ast.Constant))
        elif isinstance(node, ast.Raise) and node.exc is not None:  # a bare re-raise decides nothing of its own
            raised = _call_name(node.exc.func if isinstance(node.exc, ast.Call) else node.exc)
            found.raised.setdefault(raised or "an exception", where(node))
        if not isinstance(node, ast.Call):
            continue
        called = _call_name(node.func)
        if called is not None:
            found.calls.setdefault(called, where(node))
        if called in LOSS_CALLS:
            for keyword in node.keywords:
                if keyword.arg in ("reduction", "ignore_index") and isinstance(keyword.value, ast.Constant):
                    found.keywords.setdefault((called, keyword.arg), (keyword.value.value, where(node)))
        on_self = isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) \
            and node.func.value.id == "self"
        if isinstance(node.func, ast.Name) and node.func.id == "self" or (on_self and node.func.attr == "forward"):
            callees.append("forward")
            for argument in [*node.args, *(k.value for k in node.keywords)]:
                for part in ast.walk(argument):
                    name = _self_attribute(part) if isinstance(part, ast.Attribute) else None
                    if name is not None:
                        passed.add(name)
        elif on_self and node.func.attr in ("log", "log_dict"):
            _read_logged(node, where(node), found)
        elif on_self:
            callees.append(node.func.attr)
    for name in passed & set(assigned):
        found.carried.setdefault(name, f"{method}, line {assigned[name] + offset}")
    return callees


def _read_logged(node: ast.Call, where: str, found: StepSource) -> None:
    if not node.args:
        return
    first = node.args[0]
    flags = {k.arg: k.value.value for k in node.keywords if k.arg in ("on_step", "on_epoch")
             and isinstance(k.value, ast.Constant) and isinstance(k.value.value, bool)}
    if node.func.attr == "log":  # type: ignore[attr-defined]
        names = [str(first.value) if isinstance(first, ast.Constant) else "?"]
    elif isinstance(first, ast.Dict):
        names = [str(key.value) if isinstance(key, ast.Constant) else "?" for key in first.keys]
    else:
        names = ["?"]
    for name in names:
        found.logged.setdefault(name, where)
        if flags and name != "?":
            found.log_flags.setdefault(name, flags)


def training_log_flags(module: nn.Module) -> dict[str, dict[str, bool]]:
    """The literal ``on_step`` / ``on_epoch`` of each metric ``module`` 's own ``training_step`` logs (the methods it
    calls included), by name: the pipeline logs the metrics it shares with the step as the step does."""
    cls = type(module)
    if not callable(getattr(cls, "training_step", None)) or _base_method(cls, "training_step"):
        return {}
    return read_methods(cls, ["training_step"]).log_flags


def parameters_outside(module: nn.Module, block_paths: Iterable[str]) -> list[str]:
    """Names of ``module``'s parameters that no declared block holds (they would never be trained)."""
    paths = tuple(f"{path}." for path in block_paths)
    return [name for name, _ in module.named_parameters() if not name.startswith(paths)]


def audit(module: nn.Module, declaration: Any, pipeline_metrics: Iterable[str] = (), split: bool = False,
          ) -> list[Finding]:
    """What ``module`` 's ``training_step`` (and, on a split model, its gradient hooks) does that the pipeline
    running ``declaration`` would not.

    Args:
        module: the user's module (whole, before pruning).
        declaration: its :class:`~lightning_mp_lstm.models.declaration.LSTMBlocks`.
        pipeline_metrics: the training metric names the strategy logs for it (besides the loss terms the declared
            methods return, which are read from their source).
        split: each process holds part of the model (pipeline or tensor parallel): a hook that clips by the norm of
            ``self.parameters()`` clips by a part's.
    """
    cls, d = type(module), declaration
    findings = (_clip_findings(cls) if split else []) + _backward_findings(cls) + _evaluation_findings(cls, d)
    if not hasattr(cls, "training_step") or _base_method(cls, "training_step"):
        return findings
    step = read_methods(cls, ["training_step"])
    pieces = read_methods(cls, list(d.hooks.values()))
    declared = {path.split(".")[0] for path in (d.embedding, d.lstm, d.decoder)}
    declared |= {value.split(".")[0] for value in (d.dropout, d.layer_dropout) if isinstance(value, str)}
    hook_fix = "compute it in a method the declaration names (LSTMBlocks(embed=..., after_lstm=..., loss=..., " \
               "penalty=...))"
    children = dict(module.named_children())
    for name, where in sorted(step.attributes.items()):
        if name in children and name not in declared and name not in pieces.attributes:
            findings.append(Finding(f"submodule {name} ({type(children[name]).__name__}), used by {where}, is not run "
                                    "by the pipeline", hook_fix))
    for call, where in sorted(step.calls.items()):
        if call in RANDOM_CALLS and call not in pieces.calls and not (call == "dropout" and _declares_dropout(d)):
            findings.append(Finding(f"a random draw, {call}(...) in {where}, is not made by the pipeline", hook_fix))
    if not d.carry_state:
        for name, where in sorted(step.carried.items()):
            findings.append(Finding(f"self.{name} is kept across batches and fed back to the model ({where}): "
                                    "state carried across batches", "declare carry_state=True"))
    findings += _loss_findings(step, d) + _output_findings(cls)
    for name, where in sorted(step.raised.items()):
        if name not in pieces.raised:
            findings.append(Finding(f"the step raises {name} ({where}), a check the pipeline never makes",
                                    "make it in a hook that sees the step's loss (on_train_batch_end: outputs['loss']) "
                                    "or in a method the declaration names"))
    logged = {d.log_name.format(split="train", metric=m) for m in ("loss", *_terms(cls, d.hooks))}
    logged |= set(pipeline_metrics)
    for name, where in sorted(step.logged.items()):
        if name == "?":
            findings.append(Finding(f"a metric under a computed name, logged in {where}, could not be matched with "
                                    "what the pipeline logs", "check it with MPLSTMStrategy(verify=True)"))
        elif name not in logged:
            findings.append(Finding(f"metric {name!r}, logged in {where}, is not logged by the pipeline (it logs "
                                    f"{', '.join(sorted(logged))})", "return it as a named term of the declared "
                                    "loss or penalty method, or set log_name to the names the module logs"))
    for name in pieces.unread + step.unread:
        findings.append(Finding(f"the source of {cls.__name__}.{name} could not be read, so nothing in it was checked",
                                "run MPLSTMStrategy(verify=True)"))
    return findings


def _clip_findings(cls: type) -> list[Finding]:
    """A clip or a measure by norm in the module's gradient hooks: each process would clip by, or log, its own part's
    norm."""
    hooks = read_methods(cls, list(GRADIENT_HOOKS))
    fix = ("clip with Trainer(gradient_clip_val=...), which the strategy applies with the whole model's norm (in "
           "configure_gradient_clipping: self.clip_gradients(optimizer, gradient_clip_val=..., "
           "gradient_clip_algorithm='norm'))")
    reads = ("to log the whole model's norm, sum the parts' squared norms over the pipeline (and tensor-parallel) "
             "group first: trainer.strategy.device_mesh['pipeline_parallel'].get_group()")
    return [Finding(f"{call}(...) in {where} clips by the norm of this process's part of the model, not of the "
                    "whole model", fix)
            for call, where in sorted(hooks.calls.items()) if call in NORM_CLIPS] + [
            Finding(f"{call}(...) in {where} measures this process's part of the model: a total norm it gives is not "
                    "the whole model's, and Lightning's loggers write global rank 0's part only", reads)
            for call, where in sorted(hooks.calls.items()) if call in NORM_READS]


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


def _evaluation_findings(cls: type, d: Any) -> list[Finding]:
    """A metric the module's own ``validation_step`` / ``test_step`` logs that the pipeline's evaluation does not."""
    findings = []
    for split, method in (("val", "validation_step"), ("test", "test_step")):
        if not callable(getattr(cls, method, None)) or _base_method(cls, method):
            continue
        logged = {d.log_name.format(split=split, metric=m) for m in ("loss", "ppl", *_terms(cls, d.hooks))}
        for name, where in sorted(read_methods(cls, [method]).logged.items()):
            if name != "?" and name not in logged:
                findings.append(Finding(
                    f"metric {name!r}, logged in {where}, is not logged by the pipeline's evaluation, which runs in "
                    f"place of {cls.__name__}.{method} (it logs {', '.join(sorted(logged))})",
                    "compute it from trainer.predict's outputs (each target's log-probability, the predicted next "
                    "tokens), e.g. in a callback"))
    return findings


def _terms(cls: type, hooks: dict[str, str]) -> set[str]:
    """The loss terms the pipeline logs for the declared methods: the literal keys of the dicts they return (a
    penalty returning one tensor is the term ``penalty``)."""
    terms: set[str] = set()
    for role in ("loss", "penalty"):
        if role in hooks:
            keys = read_methods(cls, [hooks[role]]).returned_keys
            terms |= keys or ({"penalty"} if role == "penalty" else set())
    return terms


def _declares_dropout(declaration: Any) -> bool:
    return any(value not in (None, 0, 0.0) for value in (declaration.dropout, declaration.layer_dropout))


def _output_findings(cls: type) -> list[Finding]:
    """The keys besides ``loss`` of the dicts ``training_step`` itself returns: Lightning hands them to
    ``on_train_batch_end`` as ``outputs``, where the pipeline's step returns the loss alone."""
    try:
        function = cls.training_step
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError, IndentationError):
        return []  # read_methods reports it unread
    code = getattr(function, "__code__", None)
    offset = code.co_firstlineno - 1 if code is not None else 0
    extra: dict[str, int] = {}
    pending = list(ast.iter_child_nodes(tree.body[0])) if tree.body else []
    while pending:  # the method's own returns, not those of functions defined inside it
        node = pending.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
            for key in node.value.keys:
                if isinstance(key, ast.Constant) and key.value != "loss":
                    extra.setdefault(str(key.value), node.lineno + offset)
        pending.extend(ast.iter_child_nodes(node))
    if not extra:
        return []
    keys = ", ".join(repr(k) for k in sorted(extra))
    return [Finding(f"training_step, line {min(extra.values())}, returns {keys} beside 'loss', which Lightning hands "
                    "to on_train_batch_end as outputs: the pipeline's outputs hold the loss alone",
                    "compute them in on_train_batch_end from the batch and outputs['loss'], or in a method the "
                    "declaration names")]


def _loss_findings(step: StepSource, d: Any) -> list[Finding]:
    findings = []
    builtin = "loss" not in d.hooks
    for (call, keyword), (value, where) in sorted(step.keywords.items()):
        if keyword == "reduction" and builtin and _REDUCTION_OF.get(value, value) != d.reduction:
            fix = (f"declare reduction={_REDUCTION_OF[value]!r}" if value in _REDUCTION_OF
                   else "declare the loss as a method (loss=...)")
            findings.append(Finding(f"{call}(..., reduction={value!r}) in {where} is not the declared "
                                    f"reduction={d.reduction!r}", fix))
        if keyword == "ignore_index" and value != d.ignore_index and value != -100:
            findings.append(Finding(f"{call}(..., ignore_index={value!r}) in {where} is not the declared "
                                    f"ignore_index={d.ignore_index!r}", f"declare ignore_index={value!r}"))
    return findings


def render_findings(module_name: str, findings: list[Finding]) -> str:
    """One message naming every finding and its fix."""
    lines = [f"mp_lstm runs the pieces {module_name} declares in configure_pipeline() in place of "
             f"{module_name}.training_step, and its hooks on each process's part of the model; they do not reproduce "
             "all of it:"]
    lines += [f"  - {f.what}: {f.fix}" for f in findings]
    lines.append(f"Check the declaration numerically with MPLSTMStrategy(verify=True) (see {DOCS_PAGE}).")
    return "\n".join(lines)

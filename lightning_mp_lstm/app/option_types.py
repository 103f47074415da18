"""A config option given a word where its class takes a number, or a number out of its range, is refused by name,
before anything is built.

Without this, ``python train.py model.optimizer.lr=fast`` fails after launching, inside ``torch.optim.Adam``, with
``TypeError: '<=' not supported between instances of 'float' and 'str'``, naming neither the option nor the value.
:func:`check_option_types` reads the signature of every ``_target_`` of a config group and refuses a text value
for a parameter that takes only numbers (its default is a number, or its annotation names ``int`` or ``float``
and no ``str``). :func:`check_option_values` refuses, by name, a number out of its range for the options that
nothing checks before they are used (``data.batch_size=-3`` sized a tensor before the data module checked it, and
``model.optimizer.lr=-3`` reached ``torch.optim`` only after the processes had started).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, ListConfig, OmegaConf

__all__ = ["check_option_types", "check_option_values"]

_NUMBER = re.compile(r"\b(int|float)\b")
_NOT_ONLY_NUMBERS = re.compile(r"\b(str|Any|Literal|object)\b")


def _takes_only_numbers(parameter: inspect.Parameter) -> bool:
    default, annotation = parameter.default, parameter.annotation
    text = "" if annotation is inspect.Parameter.empty else str(annotation)
    if _NOT_ONLY_NUMBERS.search(text) or isinstance(default, (bool, str)):
        return False
    return isinstance(default, (int, float)) or bool(_NUMBER.search(text))


def _parameters(target: Any) -> dict[str, inspect.Parameter]:
    try:
        return dict(inspect.signature(get_object(target)).parameters)
    except Exception:  # noqa: BLE001  (an unknown target or no signature: instantiating it reports that)
        return {}


def check_option_types(node: Any, path: str) -> None:
    """Refuse, naming ``<path>.<key>``, a text value given to a parameter that takes only numbers, in ``node`` and
    the config nodes inside it (each with its own ``_target_``).

    Args:
        node: a config node (``cfg.model``...); nodes without ``_target_`` are only searched.
        path: the node's name in the config, for the message (``"model"``).

    Raises:
        TypeError: ``model.optimizer.lr must be a number (torch.optim.Adam's lr), got 'fast'``.
    """
    if not isinstance(node, DictConfig):
        return
    target = None
    if "_target_" in node and not OmegaConf.is_interpolation(node, "_target_"):
        target = node._get_node("_target_")._value()
    parameters = _parameters(target) if isinstance(target, str) else {}
    for key in node:
        if str(key).startswith("_") or OmegaConf.is_interpolation(node, key):
            continue
        child = node._get_node(key)
        if isinstance(child, DictConfig):
            check_option_types(child, f"{path}.{key}")
            continue
        value = child._value()  # unresolved: interpolations elsewhere stay untouched
        if isinstance(value, str) and key in parameters and _takes_only_numbers(parameters[key]):
            raise TypeError(f"{path}.{key} must be a number ({target}'s {key}), got {value!r}")


# ----- values out of range -----------------------------------------------------------------------------------------
def _positive_int(name: str, value: Any, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _non_negative_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def _positive_number(name: str, value: Any, nullable: bool = False) -> None:
    if value is None and nullable:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise ValueError(f"{name} must be a positive number, got {value!r}")


def _lengths(name: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)):  # 'auto', null, or a word the data module refuses by name
        return
    if not value or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
        raise ValueError(f"{name}: bucket lengths must be a non-empty list of positive integers, got {value!r} "
                         "(or 'auto', or null)")


def _length_cap(name: str, value: Any) -> None:
    if value is not None and value != "auto":
        _positive_int(name, value)


def _steps(name: str, value: Any) -> None:
    if not isinstance(value, (list, tuple)) or any(isinstance(v, bool) or not isinstance(v, int) or v < 0
                                                   for v in value):
        raise ValueError(f"{name} must be a list of global steps (integers >= 0), got {value!r}")


def _seed(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32:
        raise ValueError(f"{name} must be an integer from 0 to {2**32 - 1}, got {value!r}")


#: ``train.py`` options whose values nothing checks before they are used (to size a tensor, after the processes
#: start, or never) or before the model's tensors are built (the callbacks), each with its check. The others are
#: checked by their own class when it is built, before it builds anything: the strategy's and layout's options, the
#: model's sizes, the data module's other options.
_VALUE_CHECKS: dict[str, Any] = {
    "seed": _seed,
    "data.batch_size": lambda n, v: _positive_int(n, v, nullable=True),
    "data.eval_batch_size": lambda n, v: _positive_int(n, v, nullable=True),
    "data.max_tokens": lambda n, v: _positive_int(n, v, nullable=True),
    "data.buckets": _lengths,
    "data.num_auto_buckets": lambda n, v: _positive_int(n, v, nullable=True),
    "data.synthetic.num_train": _non_negative_int,
    "data.synthetic.num_valid": _non_negative_int,
    "data.synthetic.num_test": _non_negative_int,
    "data.synthetic.vocab_size": _positive_int,
    "buckets.lengths": _lengths,
    "buckets.num_buckets": lambda n, v: _positive_int(n, v, nullable=True),
    "buckets.max_length": _length_cap,  # the data module names it max_bucket_length
    "model.init_range": lambda n, v: _positive_number(n, v, nullable=True),
    "layout.processes": _length_cap,  # a positive integer or auto
    "strategy.report_after_steps": lambda n, v: _positive_int(n, v, nullable=True),
    "callbacks.progress_bar.refresh_rate": _non_negative_int,
    "callbacks.timeline.steps": _steps,
    # Checked by DivergenceGuard too, but the callbacks are built after the model.
    "callbacks.divergence.max_loss": lambda n, v: _positive_number(n, v, nullable=True),
    "callbacks.divergence.patience": lambda n, v: _positive_int(n, v, nullable=True),
}


def _optimizer(node: Any) -> None:
    """Build a ``torch.optim`` optimizer partial of the model over no parameters: torch checks its arguments (the
    learning rate...) before it finds the parameter list empty. Other optimizers are left to themselves."""
    if not isinstance(node, DictConfig) or "_target_" not in node or OmegaConf.is_interpolation(node, "_target_"):
        return
    target = node._get_node("_target_")._value()
    if not (isinstance(target, str) and target.startswith("torch.optim.")):
        return
    arguments: dict[str, Any] = {}
    try:
        arguments = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not str(k).startswith("_")}
        get_object(target)([], **arguments)
    except ValueError as error:
        if "empty parameter list" not in str(error):
            given = ", ".join(f"{k}={v!r}" for k, v in arguments.items())
            raise ValueError(f"model.optimizer: {target} refuses its arguments ({given}): {error}") from None
    except Exception:  # noqa: BLE001  (anything else surfaces, as it did, when the model builds its optimizer)
        return


def check_option_values(cfg: DictConfig) -> None:
    """Refuse, naming the option, a value out of its range among the options of ``train.py``'s config that nothing
    else checks before they are used (:data:`_VALUE_CHECKS`, and a ``torch.optim`` optimizer's arguments): call it
    first, before anything is built. An option set by interpolation (``data.batch_size: ${...}``) is checked where its
    value is given; an absent one is skipped.

    Raises:
        ValueError: ``data.batch_size must be a positive integer, got -3``.
    """
    for name, check in _VALUE_CHECKS.items():
        parent, _, key = name.rpartition(".")
        node = OmegaConf.select(cfg, parent) if parent else cfg
        if not isinstance(node, DictConfig) or key not in node or OmegaConf.is_interpolation(node, key):
            continue
        value = node[key]
        check(name, OmegaConf.to_container(value, resolve=True) if isinstance(value, ListConfig) else value)
    _optimizer(OmegaConf.select(cfg, "model.optimizer"))

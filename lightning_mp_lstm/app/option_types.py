"""A config option given a word where its class takes a number is refused by name, before anything is built.

Without this, ``python train.py model.optimizer.lr=fast`` fails after launching, inside ``torch.optim.Adam``, with
``TypeError: '<=' not supported between instances of 'float' and 'str'``, naming neither the option nor the value.
:func:`check_option_types` reads the signature of every ``_target_`` of a config group and refuses a text value
for a parameter that takes only numbers (its default is a number, or its annotation names ``int`` or ``float``
and no ``str``).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf

__all__ = ["check_option_types"]

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

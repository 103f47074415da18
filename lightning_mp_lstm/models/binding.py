"""A module's pipeline view: its ``configure_pipeline()`` declaration bound to it.

The declaration (:class:`~lightning_mp_lstm.models.declaration.LSTMBlocks`) only names parts of a module; binding it
builds the :class:`~lightning_mp_lstm.models.language_model_blocks.LanguageModelBlocks` that the planner and the
engine read (:class:`~lightning_mp_lstm.models.contract.PipelineModel`). This module sits above both, so the
declaration never needs to know what binds it.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_mp_lstm.models.contract import PipelineModel, check_model
from lightning_mp_lstm.models.declaration import LSTMBlocks, ModelDeclarationError, missing_declaration_message
from lightning_mp_lstm.models.language_model_blocks import LanguageModelBlocks

__all__ = ["bind", "pipeline_model"]


def bind(declaration: LSTMBlocks, module: nn.Module, seed: int | None = None) -> PipelineModel:
    """The pipeline view of ``module`` as ``declaration`` describes it (checks that the named submodules and methods
    exist and have the right kinds).

    Args:
        declaration: the module's ``configure_pipeline()`` declaration.
        module: the LightningModule (or any ``nn.Module``) the names refer to.
        seed: the seed of the per-block initial values of a module built on meta (default: torch's initial
            seed, which ``seed_everything`` sets on every rank).
    """
    return LanguageModelBlocks(module, declaration, torch.initial_seed() if seed is None else seed)


def pipeline_model(module: nn.Module, seed: int | None = None) -> PipelineModel:
    """The pipeline view of ``module``: its ``configure_pipeline()`` declaration bound to it, or the
    :class:`~lightning_mp_lstm.models.contract.PipelineModel` that method returns for a custom model (a pipeline view
    is returned as it is).

    Raises:
        ModelDeclarationError: ``module`` has no ``configure_pipeline()`` (the message shows the two lines to add),
            or its declaration does not fit it.
    """
    configure = getattr(module, "configure_pipeline", None)
    if configure is None:
        if isinstance(module, PipelineModel):
            return module  # already a pipeline view
        raise ModelDeclarationError(missing_declaration_message(module))
    declared = configure()
    if isinstance(declared, LSTMBlocks):
        return bind(declared, module, seed)
    try:
        check_model(declared)
    except TypeError as error:
        raise ModelDeclarationError(
            f"{type(module).__name__}.configure_pipeline() must return LSTMBlocks(...) or an object implementing "
            f"lightning_mp_lstm.PipelineModel; {error}"
        ) from None
    return declared

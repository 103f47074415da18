"""lightning-mp-lstm: pipeline (model) parallel training of LSTM language models in PyTorch Lightning.

Importing the package registers the ``"mp_lstm"`` strategy name with Lightning, so
``Trainer(strategy="mp_lstm")`` works. Nothing else happens at import: no data, no processes.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mp_lstm.checkpoint import CheckpointError
from lightning_mp_lstm.data import LMDataModule
from lightning_mp_lstm.models.contract import PipelineModel
from lightning_mp_lstm.models.declaration import LSTMBlocks, ModelDeclarationError
from lightning_mp_lstm.models.lstm_language_model import LSTMLanguageModel
from lightning_mp_lstm.planning.layout import LayoutError, ParallelLayout
from lightning_mp_lstm.planning.partition import PartitionError
from lightning_mp_lstm.strategy.divergence import DivergenceError, DivergenceGuard
from lightning_mp_lstm.strategy.stopping import RunStopped, StopOnSignal
from lightning_mp_lstm.strategy.strategy import MPLSTMStrategy
from lightning_mp_lstm.timeline import PipelineTimeline

__all__ = ["CheckpointError", "DivergenceError", "DivergenceGuard", "LMDataModule", "LSTMBlocks", "LSTMLanguageModel",
           "LayoutError", "MPLSTMStrategy", "ModelDeclarationError", "ParallelLayout", "PartitionError",
           "PipelineModel", "PipelineTimeline", "RunStopped", "StopOnSignal"]
__version__ = "0.1.0"

MPLSTMStrategy.register_strategies(StrategyRegistry)

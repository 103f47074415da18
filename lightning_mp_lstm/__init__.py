"""lightning-mp-lstm: pipeline (model) parallel training of LSTM language models in PyTorch Lightning.

Importing the package registers the ``"mp_lstm"`` strategy name with Lightning, so
``Trainer(strategy="mp_lstm")`` works. Nothing else happens at import: no data, no processes.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_mp_lstm.layout import LayoutError, ParallelLayout
from lightning_mp_lstm.model import LSTMLanguageModel
from lightning_mp_lstm.partition import PartitionError
from lightning_mp_lstm.strategy import MPLSTMStrategy

__all__ = ["LSTMLanguageModel", "LayoutError", "MPLSTMStrategy", "ParallelLayout", "PartitionError"]
__version__ = "0.1.0"

MPLSTMStrategy.register_strategies(StrategyRegistry)

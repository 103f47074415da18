"""What a model is to the engine: the contract (``PipelineModel``), a LightningModule's declaration (``LSTMBlocks``)
and its binding into pipeline blocks (``binding``, ``language_model_blocks``, ``blocks``, ``objective``,
``batch_layout``, ``carried_state``, ``vocabulary_parallel``), the analytic costs of those blocks, what a module's
structure proves the pipeline would not reproduce (``module_audit``), the library's own ``LSTMLanguageModel``
(``lstm_language_model``, with ``vocab_padding``) and what a language model logs (``metrics``).

Knows nothing of layouts, the engine or the strategy; the public names are importable from ``lightning_mp_lstm``.
"""

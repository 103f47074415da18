"""The applications: ``train.py``'s Hydra app (``training``), ``generate.py``'s sampling (``generation``) and the
``python -m lightning_mp_lstm.app.verify`` command (``verify``), with what only they use: the console's filters
(``console``), the run folder's name (``run_name``) and the config's option types (``option_types``).
"""

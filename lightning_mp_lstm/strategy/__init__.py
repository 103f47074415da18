"""The Lightning side: ``MPLSTMStrategy`` (``strategy``), one class holding every hook Lightning calls, over the running
pipeline it owns (``pipeline_run``), its collectives (``collectives``) and precision plugin (``precision``); the setup
from a module to a running engine (``pipeline_setup``), the process options (``options``), the launcher
(``launcher``), the Trainer's stop conditions (``stopping``, ``divergence``), the whole model's summary (``summary``)
and ``verify=True`` (``verify``, with ``random_tape``).

``MPLSTMStrategy`` is importable from ``lightning_mp_lstm``.
"""

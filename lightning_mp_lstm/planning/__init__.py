"""Planning a run before it starts: the layout and its device mesh (``layout``), partitions of the blocks
(``partition``), block times (``profile``), the frozen plan every rank agrees on (``plan``), its report
(``report``), advice on how to use the devices (``advice``) and the activation-memory check (``activations``).

Reads a model only through its contract; imports neither Lightning nor the strategy.
"""

"""The floor every other folder stands on: errors shared by the ranks and naming a lost rank (``faults``), argument
checks with the option's name in the message (``validation``), and running a function on several local processes
under a deadline (``testing``). Nothing here imports another folder of the package.
"""

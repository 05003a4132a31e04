"""The tools: the ``weightsync`` CLI, the embedded local cluster, the simulator and the emulated testbed.

The top of the import order: tools may import every other root, and nothing imports them.
"""

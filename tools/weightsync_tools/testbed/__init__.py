"""An emulated multi-node testbed on one machine (``weightsync bench``): see docs/testbed.md."""

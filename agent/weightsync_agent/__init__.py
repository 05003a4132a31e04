"""The weightsync agent: runs beside a trainer or an inference engine and moves its weights.

This release holds the agent's configuration and plan handling; the data plane (CPU replica,
transports, sync rounds) builds on it.
"""

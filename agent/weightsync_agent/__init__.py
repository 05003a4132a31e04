"""The weightsync agent: runs beside a trainer or an inference engine and moves its weights.

Trainer pods: CPU replicas and sources (``source_agent``), and on trainer rank 0 the coordinator of
every sync round (``coordinator``, ``rounds``). Inference pods: a watcher of the local engine
(``engine_agent``). Trainer code uses ``client.WeightSyncClient``. See docs/agent.md.
"""

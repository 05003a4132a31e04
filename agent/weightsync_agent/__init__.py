"""The weightsync agent: runs beside a trainer or an inference engine and moves its weights.

Wings (docs/architecture.md): ``client`` (what trainer code imports), ``sidecar`` (the agent process),
``rounds`` (the round driver and the coordinator on trainer rank 0), ``modes`` (p2p, broadcast),
``source`` (replicas and writers), ``targets`` (engine adapters), ``transport``, ``http``, ``layout``.
"""

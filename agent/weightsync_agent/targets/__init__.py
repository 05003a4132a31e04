"""Engine side: one folder per engine kind (``inference.adapter``) behind :class:`~weightsync_agent.targets.adapter.EngineAdapter`."""

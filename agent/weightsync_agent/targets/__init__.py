"""Engine side: one folder per engine kind (``inference.adapter``), each an
:class:`~weightsync_agent.targets.adapter.EngineAdapter` registered in :mod:`.registry`."""

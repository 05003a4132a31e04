"""Sync modes, one folder each (``transfer.mode``), behind :class:`~weightsync_agent.modes.base.SyncMode`."""

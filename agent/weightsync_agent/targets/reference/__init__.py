"""The reference engine's adapter (the engine itself is a test harness in ``weightsync_testing``)."""

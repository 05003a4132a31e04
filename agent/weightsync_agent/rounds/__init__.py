"""Sync rounds: the driver (pause, begin, write, verify, commit, resume), the coordinator, and agent-to-agent calls."""

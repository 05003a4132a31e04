"""p2p mode: every trainer rank writes its planned targets from its own replicas."""

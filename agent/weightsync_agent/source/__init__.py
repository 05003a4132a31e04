"""Trainer side: CPU replicas, the bucketed writer, a trainer pod's sources, and what the coordinator asks of them."""

"""broadcast mode: trainer rank 0 broadcasts full tensors; every engine rank cuts its own shards."""

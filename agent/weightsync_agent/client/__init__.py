"""The trainer-facing API: stage full tensors, publish a version (see :mod:`.trainer`).

::

    from weightsync_agent.client import WeightSyncClient

    client = WeightSyncClient.from_env()
    client.stage_many(model_state)   # full tensors, HF names
    client.publish(step)             # raises PublishError unless every engine committed ``step``

This package imports nothing of the sidecar's runtime: trainers talk to their sidecar over HTTP.
"""

from weightsync_agent.client.trainer import ClientError, Publisher, SidecarPublisher, WeightSyncClient
from weightsync_agent.config import replica_dir
from weightsync_agent.source.writer import Outcome, PublishError

__all__ = ["ClientError", "Outcome", "PublishError", "Publisher", "SidecarPublisher", "WeightSyncClient", "replica_dir"]

"""Inference engines as weightsync targets see them.

- :mod:`weightsync_agent.engines.api`: a typed HTTP client for SGLang's weight-update routes and the
  reference engine's ``/weightsync/`` extension routes.
- :mod:`weightsync_agent.engines.staging`: one engine rank's registered memory (live weights and an
  optional staging twin), its manifest and bucket verification.
- :mod:`weightsync_agent.engines.reference`: a small but real tensor-parallel transformer served over
  SGLang-shaped HTTP, used as the target in tests and demos.
"""

"""The weightsync operator: kopf handlers over pure manifest builders.

Layout (planner/executor split, as in LWS; pure ``build_*`` functions, as in dask-kubernetes):

- :mod:`weightsync_operator.builders` — pure: group + plan -> every object the group needs.
- :mod:`weightsync_operator.status` — pure: observed pods + plan -> the group's status.
- :mod:`weightsync_operator.kube` — a small async Kubernetes REST client (aiohttp).
- :mod:`weightsync_operator.apply` — the I/O: one idempotent reconcile of one group.
- :mod:`weightsync_operator.handlers` — thin kopf handlers that decide *when* to reconcile.
- :mod:`weightsync_operator.main` — ``run()``, what ``weightsync operator`` calls.
"""

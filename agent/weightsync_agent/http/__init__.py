"""One HTTP kit for every agent route and every peer call: server, request parsing, client, error shape.

Every error answer, from an agent or the reference engine, has the one shape ``{"error": {"message": ...}}``
(:func:`~weightsync_agent.http.server.error_response`); the client turns it back into
:class:`~weightsync_agent.http.client.HttpCallError`.
"""

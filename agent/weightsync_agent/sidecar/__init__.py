"""The agent process: identity and plan, the background loop, the HTTP routes, reporting on its own pod."""

"""The HTTP edge, shared by every route: the edge middleware (no tracebacks, quiet disconnects,
body limits), the one body reader (auth before body, size, read timeout, JSON depth), the
request-scoped dependencies, and the uvicorn server settings. (Bounded JSON parsing is gateway.client_json: batch files use it too.)

Nothing is imported here; import the modules. Below the routes, above the runtime.
"""

"""``qinfer serve``: the OpenAI-compatible HTTP server, its metrics and the web chat page, on the engine."""

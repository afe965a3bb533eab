"""`llamactl serve`: the engine (continuous batching over the slotted cache), the OpenAI-compatible
HTTP API on top of it, and the server process (uvicorn)."""

"""The HTTP gateway (FastAPI under Ray Serve). Lands with its own issue."""

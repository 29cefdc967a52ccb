"""The HTTP gateway: FastAPI under Ray Serve, in front of one WorkerPool per served model."""

from .app import build_app
from .config import Settings

__all__ = ["Settings", "build_app"]

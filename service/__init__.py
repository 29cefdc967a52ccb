"""The HTTP gateway: FastAPI under Ray Serve, in front of one WorkerPool per served model.

Attributes load lazily, so that `ppo_logprobs.service.schemas` (pydantic only) can be used by clients without
Ray, torch or FastAPI.
"""

__all__ = ["Settings", "build_app"]


def __getattr__(name: str):
    if name == "Settings":
        from .config import Settings

        return Settings
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""llmserve on Ray Serve: engine replicas as a Ray Serve deployment behind an ingress that forwards each
request, through a streaming DeploymentHandle and our prefix-aware request router, to one replica's own
copy of our FastAPI app (server/api_server.py). Ray owns the processes: it places, restarts and autoscales
the replicas. Nothing below this package imports it; `ray` itself is imported only here, lazily."""

from __future__ import annotations

RAY_VERSION = "2.60.0"  # the version tested (pyproject's `ray` extra)
INSTALL_HINT = f'pip install "llmserve[ray]" (or: pip install "ray[serve]=={RAY_VERSION}")'


def require_ray():
    """`ray.serve`, or an ImportError that says how to install it."""
    try:
        from ray import serve
    except ImportError as e:
        raise ImportError(f"llmserve on Ray Serve needs Ray Serve, which is not installed ({e}); "
                          f"install it with: {INSTALL_HINT}") from None
    return serve

"""The expertd client: mlx-lm models whose routed experts stream through the daemon."""

from .loader import load

__all__ = ["load"]

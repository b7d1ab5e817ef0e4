"""The one definition of expertd's shared-memory arena, used by the daemon and its clients."""

from .layout import (
    ARENA_MAGIC,
    LAYOUT_VERSION,
    Arena,
    Geometry,
    SlotState,
)

__all__ = ["ARENA_MAGIC", "LAYOUT_VERSION", "Arena", "Geometry", "SlotState"]

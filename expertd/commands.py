"""Subcommands that talk to the daemon: start, stop, status, generate, demo."""


def add_subcommands(sub) -> None:
    """Registers the daemon-facing subcommands (filled in as they are built)."""

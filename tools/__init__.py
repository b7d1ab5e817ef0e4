"""Tools that are neither the daemon nor the client: convert, synth, demo and their helpers."""

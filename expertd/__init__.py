"""expertd: stream the routed experts of MoE models from the SSD through one shared cache daemon."""

__version__ = "0.1.0"

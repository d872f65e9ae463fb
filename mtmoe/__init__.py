"""mtmoe: a reference benchmark suite for sparse mixture-of-experts gates in multi-task models."""

__version__ = "0.1.0"

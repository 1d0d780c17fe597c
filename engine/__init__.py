"""Shoal: pool your own machines into one private LLM endpoint."""

__version__ = "0.1.0"

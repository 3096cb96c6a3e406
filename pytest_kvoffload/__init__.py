"""pytest-kvoffload: measure when loading a cached KV prefix beats recomputing it, with real vLLM servers."""

__version__ = "0.1.0"

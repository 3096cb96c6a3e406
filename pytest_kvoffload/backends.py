"""The public import of a backend's types for plugins (README, "Adding a backend"): `from
pytest_kvoffload.backends import Backend, ServerSpec` keeps working after the move to serve/backend.py."""

from pytest_kvoffload.serve.backend import Backend, ServerSpec

__all__ = ["Backend", "ServerSpec"]

"""hermes-service: the Hermes Agent CLI behind a REST API (see README.md)."""
from .app import create_app

__all__ = ["create_app"]

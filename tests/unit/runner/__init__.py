"""Unit tests of ``hermes_service.runner`` (one file per module, as in the package)."""

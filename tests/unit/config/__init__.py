"""Unit tests of ``hermes_service.config`` (one file per module, as in the package)."""

"""Unit tests of ``hermes_service.sandbox`` (one file per module, as in the package)."""

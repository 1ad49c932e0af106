"""Unit tests of ``hermes_service.sandbox.net`` (one file per module, as in the package)."""

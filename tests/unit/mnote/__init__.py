"""Unit tests of ``hermes_service.mnote`` (one file per module, as in the package)."""

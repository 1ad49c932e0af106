"""Unit tests of ``hermes_service.hermes_site`` (one file per module, as in the package)."""

"""Unit tests of ``hermes_service.scripted_model`` (one file per module, as in the package)."""

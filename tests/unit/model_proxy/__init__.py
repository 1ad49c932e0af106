"""Unit tests of ``hermes_service.model_proxy`` (one file per module, as in the package)."""

"""End-to-end tests: real parts (tests/conftest.py)."""

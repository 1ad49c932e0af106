"""Unit tests: everything in the test process (tests/conftest.py). A package so that an end-to-end
file can share a unit file's helpers (``from unit.test_retention import run_gc``)."""

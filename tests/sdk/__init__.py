"""Tests of the Python SDK and worker harness (python/torpor). A package, so that its conftest
does not shadow tests/conftest.py, which other test modules import as `conftest`."""

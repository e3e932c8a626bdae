"""A model family registered from outside the package (`tests/test_family_registry.py`)."""

__version__ = "0.2.0"  # always outbox-relay's (tests/unit/test_release.py)

"""What the test modules share: the CLI and run harness (``runs``), the rank harness (``ranks``), tiny
family configs (``families``), reference checks and tolerances per area. Test modules import these,
never each other; ``conftest.py`` holds fixtures and hooks only (``tests/unit/test_architecture.py``)."""

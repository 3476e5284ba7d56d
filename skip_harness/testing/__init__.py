"""Recordings as tests: the pytest plugin (`skip_harness.testing.pytest_plugin`, installed as the `pytest11`
entry point `skip_harness`)."""

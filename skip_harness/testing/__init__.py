"""What skip_harness gives a test suite: recordings as tests (the pytest plugin,
`skip_harness.testing.pytest_plugin`, installed as the `pytest11` entry point `skip_harness`), and the storage
protocol's tests a backend inherits (`skip_harness.testing.store_tests.StoreTests`)."""

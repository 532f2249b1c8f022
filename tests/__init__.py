"""specjax's tests, grouped like the packages (the layers of docs/ARCHITECTURE.md): a folder per package, the
helpers every folder may use in tests/helpers/, shared fixtures in conftest.py (here and in a folder), the
recorded references in tests/data/.  No test file imports another."""

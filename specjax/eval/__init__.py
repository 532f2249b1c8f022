"""Uses of the API that measure and report: paired benchmarks (``bench``), pass@1 of generated code (``codeeval``), tables, CSV and plots (``report``)."""

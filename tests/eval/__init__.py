"""specjax/eval/ with experiments/, configs/ and the benchmark scripts (layer 6): paired benchmarks, the
experiments, every config at tiny size, the coder pair's machinery."""

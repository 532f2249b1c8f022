"""specjax/speculative/ (layer 3): the engine, every drafter, token trees, losslessness, recording and replay."""

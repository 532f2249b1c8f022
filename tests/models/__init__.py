"""specjax/models/ (layer 2): the forward against a numpy reference, the model families against transformers,
per-row sampling settings, and the default real model."""

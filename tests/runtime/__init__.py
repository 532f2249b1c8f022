"""specjax/runtime/ (layer 5): the builder, compiled executables and their caches, start-up, huge pages."""

"""specjax/parallel/ (layer 2): decoding over a device mesh, and over several processes."""

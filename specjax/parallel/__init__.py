"""Running on several devices: the mesh and partition rules (``sharding``) and multi-process start (``distributed``)."""

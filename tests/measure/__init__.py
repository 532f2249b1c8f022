"""specjax/measure/ (layer 4): the cost model, projection onto other devices, the memory bill."""

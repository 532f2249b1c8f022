"""The model layer: the decoder forward over parameter pytrees, its config, the preallocated KV cache, quantized weights, prefill and sampling."""

"""specjax/kernels/ (layer 1): the native CPU kernels against their references on every instruction-set path
(emulated too), quantized weights and the integer-dot kernel, the stored kernel choice, Pallas tree attention."""

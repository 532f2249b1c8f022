"""Measuring this machine, above the model: the CPU kernel paths (``kernel_paths``, run at load) and the
roofline the cost model predicts with (``calibrate``, with its bandwidth probes).  The kernels below only read
what is stored here (``specjax.kernels.choices``, ``<cache>/calibration``)."""

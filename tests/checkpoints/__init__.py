"""specjax/checkpoints/ (layer 4): GGUF and safetensors checkpoints, the quantized weight cache, and drafters in
their published layouts."""

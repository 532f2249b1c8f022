"""Checkpoint loading: GGUF files, Hugging Face safetensors directories, tokenizers, the model registry.

  load_model("smollm2-135m")           # registry name (downloaded once into the cache)
  load_model("/path/model.Q8_0.gguf")  # a GGUF file
  load_model("/path/hf_model_dir")     # a directory with config.json + *.safetensors + tokenizer.json
  load_config("/path/hf_model_dir")    # its config alone (config.json; a GGUF file's metadata)
"""
from specjax.checkpoints.gguf_loader import load_gguf, permute_qk_llamacpp, unpermute_qk_llamacpp
from specjax.checkpoints.catalog import (KNOWN_MODELS, LoadedModel, cache_dir, fetch, list_models,
                                          load_config, load_model, resolve)
from specjax.checkpoints.safetensors_loader import load_hf_dir
from specjax.checkpoints.tokenizer import Tokenizer

__all__ = [
    "KNOWN_MODELS", "LoadedModel", "Tokenizer", "cache_dir", "fetch", "list_models", "load_config", "load_gguf",
    "load_hf_dir", "load_model", "permute_qk_llamacpp", "resolve", "unpermute_qk_llamacpp",
]

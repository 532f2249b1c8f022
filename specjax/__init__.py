"""specjax: a JAX/XLA research framework for speculative decoding."""
from specjax.api import Generation, Model, ScoreResult, generate, load, score, tokenize
from specjax.models.config import ModelConfig
from specjax.errors import SpecjaxError

__all__ = ["Generation", "Model", "ModelConfig", "ScoreResult", "SpecjaxError", "generate", "load", "score",
           "tokenize"]
__version__ = "0.1.0"

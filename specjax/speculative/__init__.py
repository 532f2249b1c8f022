"""Speculative decoding: acceptance rules, drafters, and the jitted step / on-device loop."""
from specjax.speculative.acceptance import GreedyAcceptance, SpeculativeSampling, rule_for
from specjax.speculative.drafters import ModelDrafter, NgramDrafter, NoDrafter, layer_subset
from specjax.speculative.engine import (Engine, SpecState, SpecStats, autoregressive, generate, init, init_jit,
                                       spec_step, step_jit)

__all__ = ["Engine", "autoregressive", "init_jit", "step_jit", "GreedyAcceptance", "ModelDrafter", "NgramDrafter", "NoDrafter", "SpecState",
           "SpecStats", "SpeculativeSampling", "generate", "init", "layer_subset", "rule_for", "spec_step"]

"""Speculative decoding: acceptance rules, drafters, and the jitted step / on-device loop."""
from specjax.speculative.acceptance import GreedyAcceptance, SpeculativeSampling, rule_for
from specjax.speculative.drafters import ModelDrafter, NgramDrafter, NoDrafter, layer_subset
from specjax.speculative.eagle import EagleDrafter
from specjax.speculative.engine import (Engine, Record, Recorded, SpecState, SpecStats, autoregressive, decode_loop, decode_loop_jit,
                                       generate, init, init_jit, spec_step, step_jit)

__all__ = ["EagleDrafter", "Engine", "GreedyAcceptance", "ModelDrafter", "NgramDrafter", "NoDrafter", "Record", "Recorded", "SpecState", "SpecStats",
           "SpeculativeSampling", "autoregressive", "decode_loop", "decode_loop_jit", "generate", "init", "init_jit",
           "layer_subset", "rule_for", "spec_step", "step_jit"]

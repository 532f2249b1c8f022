"""Speculative decoding: acceptance rules, drafters (``protocol.Drafter``), the jitted step / on-device loop, and
what it records for training (``record``)."""
from specjax.speculative.acceptance import GreedyAcceptance, SpeculativeSampling, rule_for
from specjax.speculative.drafters import ModelDrafter, NgramDrafter, NoDrafter, layer_subset
from specjax.speculative.eagle import EagleDrafter
from specjax.speculative.engine import (Engine, SpecState, SpecStats, autoregressive, decode_loop, decode_loop_jit,
                                       generate, init, init_jit, spec_step, step_jit)
from specjax.speculative.protocol import Drafter
from specjax.speculative.record import Record, Recorded

__all__ = ["Drafter", "EagleDrafter", "Engine", "GreedyAcceptance", "ModelDrafter", "NgramDrafter", "NoDrafter",
           "Record", "Recorded", "SpecState", "SpecStats", "SpeculativeSampling", "autoregressive", "decode_loop",
           "decode_loop_jit", "generate", "init", "init_jit", "layer_subset", "rule_for", "spec_step", "step_jit"]

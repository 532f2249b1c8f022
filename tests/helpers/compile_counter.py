"""Count XLA compilations inside a block (``specjax.measure.compiles``, shared with the experiments)."""
from specjax.measure.compiles import count_compiles

__all__ = ["count_compiles"]

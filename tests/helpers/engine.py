"""The tiny target of the engine tests (test_speculative.py) and its prompts, shared with test_record.py."""
import numpy as np

from specjax.models import config

CFG = config.TINY.replace(num_layers=3)
DRAFT_CFG = config.TINY.replace(name="tiny-draft", num_layers=1)
BUCKETS = (16, 32, 64)

PROMPTS = np.array([[5, 6, 7, 8, 5, 6, 0, 0], [9, 10, 11, 12, 13, 14, 9, 10], [3, 0, 0, 0, 0, 0, 0, 0]],
                   np.int32)
LENS = np.array([6, 8, 1])

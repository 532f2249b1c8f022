"""Experiments: plain functions returning {"title", "rows", "summary", "plots"}; bound by gin in the CLI.

Each returns rows (one dict per table line), a summary dict, and declarative plot specs that the runner
renders (see ``specjax.eval.report.make_plot``).
"""
from experiments.acceptance_vs_k import acceptance_vs_k
from experiments import coder_pair as _coder_pair
from experiments.cross_vocab import cross_vocab
from experiments import batch_sweep as _batch_sweep
from experiments.drafter_table import drafter_table
from experiments.layerskip_search import layerskip_search
from experiments.quickstart import quickstart
from experiments import roofline as _roofline
from experiments.tree_shapes import tree_shapes
from experiments import weights as _weights
from experiments.suffix_trace import suffix_trace
from experiments import online_adapt as _online_adapt
from experiments.sampled_speed import sampled_speed

EXPERIMENTS = {"quickstart": quickstart, "acceptance_vs_k": acceptance_vs_k,
               "layerskip_search": layerskip_search, "tree_shapes": tree_shapes, "drafter_table": drafter_table,
               "roofline": _roofline.roofline, "batch_sweep": _batch_sweep.batch_sweep,
               "coder_pair": _coder_pair.coder_pair, "cross_vocab": cross_vocab, "weights": _weights.weights,
               "suffix_trace": suffix_trace, "online_adapt": _online_adapt.online_adapt,
               "sampled_speed": sampled_speed}

# Experiments that draw their own figures: plot(result, out_dir), called by the runner after results.json.
PLOTTERS = {"roofline": _roofline.plot, "batch_sweep": _batch_sweep.plot, "coder_pair": _coder_pair.plot,
            "weights": _weights.plot, "online_adapt": _online_adapt.plot}

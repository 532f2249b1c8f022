"""Record a DFlash drafter in its published layout, written by its project's own code, and its block logits,
for tests/checkpoints/test_dflash_layout.py.

  zlab  SpecForge 0.2.0's ``DFlashDraftModel`` (specforge/modeling/draft/dflash.py), saved with its own
        ``save_pretrained``: the layout of z-lab's DFlash releases (a Qwen3 ``config.json`` with ``block_size``,
        ``num_target_layers`` and ``dflash_config`` {``target_layer_ids``, ``mask_token_id``}; tensors
        ``layers.{i}.*``, ``fc``, ``hidden_norm``, ``norm``; the embedding and the head are the target's).
        Target: the tiny Qwen3 of tests/data/hf_families/qwen3 (3 layers, D = 64, 270 tokens).  Two draft layers
        of their own shape (head_dim 16, MLP width 64, RoPE base 10000), block size 4, target layers [1, 0]
        (each the *output* of that layer, hidden_states[id + 1], as z-lab's ``extract_context_feature`` reads
        them; out of order on purpose; not the last layer: transformers' last hidden state is after the final
        norm), mask token 269.
          /tmp/hfref/bin/pip install --no-deps specforge==0.2.0      # beside torch 2.13, transformers 5.25
          TORCHDYNAMO_DISABLE=1 /tmp/hfref/bin/python scripts/record_dflash_references.py zlab

  speculators  ``speculators`` 0.9.0's ``DFlashDraftModel`` (speculators/models/dflash), saved with its
        ``save_pretrained`` (what vLLM loads): ``speculators_model_type: "dflash"``, the draft layers' own config in
        ``transformer_layer_config``, ``aux_hidden_state_layer_ids`` as hidden-state *indices* (i = the output of
        layer i - 1), ``block_size``, ``mask_token_id``, ``draft_vocab_size`` with ``d2t``/``t2d`` and its own
        ``lm_head``; the embedding is the verifier's raw table (no Gemma scale), not saved.  Target: the tiny Gemma 3
        of tests/data/hf_families/gemma3 (7 layers); one draft layer (Qwen3: q/k norms), block size 5, indices
        [4, 2], a draft vocabulary of 150, mask token 3.  The logits come from the package's training forward
        (``_backbone_forward``), whose anchored blocks see the context before the anchor and their own block both
        ways, at the anchors chosen by the loss mask.  In speculators' own venv (transformers <= 5.19):
          /tmp/specref/bin/python scripts/record_dflash_references.py speculators

Recorded, float32, as ``DFlashDraftModel.spec_generate`` drafts: for a few anchors s, the context is the target's
features of tokens 0..s-1, the block is [token s, mask x (block_size - 1)] at positions s..s+block_size-1, and
the draft logits are the target's ``lm_head`` over the block's last block_size - 1 rows (depths 1..block_size-1,
one forward).  Each anchor is drafted twice — with the whole context at once, and as ``spec_generate`` does it,
through the draft's ``DynamicCache`` (a first block at an earlier anchor, the cache cropped, then the rest of
the context) — and the two must agree (1e-5) before anything is written.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from hf_family_target import draft_vocab as _draft_vocab, family_target  # noqa: E402

OUT = ROOT / "tests" / "data" / "dflash"
ANCHORS = [6, 23, 47, 80]          # the block's first position s (its token is the text's, the rest masks)
FIRST = 3                          # the cached path's first anchor, before each of ANCHORS
BLOCK, MASK, LAYER_IDS = 4, 269, [1, 0]


def _randomize(model) -> None:
  torch.manual_seed(17)
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else torch.randn_like(p) * p.shape[-1] ** -0.5)


def _block(drafter, base, x, ctx, s: int, cache=None, past: int = 0) -> torch.Tensor:
  """The draft logits [block - 1, V] of the block anchored at s, the context rows ``ctx`` at positions past..s-1."""
  block = torch.full((1, BLOCK), MASK, dtype=torch.long)
  block[0, 0] = x[0, s]
  hidden = drafter(target_hidden=ctx, noise_embedding=base.model.embed_tokens(block),
                   position_ids=torch.arange(past, s + BLOCK)[None], past_key_values=cache,
                   use_cache=cache is not None, is_causal=False)
  return base.lm_head(hidden[:, -BLOCK + 1:])[0]


def record_zlab() -> None:
  from specforge.modeling.draft.dflash import DFlashDraftModel
  base, ids = family_target("qwen3")
  c = base.config
  config = transformers.Qwen3Config(
      hidden_size=c.hidden_size, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
      num_hidden_layers=2, vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
      max_position_embeddings=c.max_position_embeddings, rope_parameters={"rope_type": "default", "rope_theta": 1e4},
      layer_types=["full_attention"] * 2)
  config.architectures = ["DFlashDraftModel"]
  config.block_size = BLOCK
  config.num_target_layers = c.num_hidden_layers
  config.dflash_config = {"target_layer_ids": LAYER_IDS, "mask_token_id": MASK}
  config._attn_implementation = "eager"
  drafter = DFlashDraftModel(config).eval()
  _randomize(drafter)
  x = torch.tensor([ids])
  cases = []
  with torch.no_grad():
    hs = base(input_ids=x, output_hidden_states=True).hidden_states
    feats = torch.cat([hs[i + 1] for i in LAYER_IDS], -1)                      # [1, T, n*D]
    for s in ANCHORS:
      logits = _block(drafter, base, x, feats[:, :s], s)
      cache = transformers.DynamicCache()
      _block(drafter, base, x, feats[:, :FIRST], FIRST, cache)
      cache.crop(-BLOCK)         # spec_generate's crop(start); transformers 5.25 counts the tokens to remove
      cached = _block(drafter, base, x, feats[:, FIRST:s], s, cache, past=FIRST)
      assert torch.allclose(logits, cached, atol=1e-5), (s, (logits - cached).abs().max())
      cases.append({"anchor": s, "logits": logits.tolist(), "top1_target": logits.argmax(-1).tolist()})
  out = OUT / "zlab"
  drafter.save_pretrained(out)
  for f in out.glob("*.py"):                      # a package's own source, if it copied any: not ours to keep
    f.unlink()
  (out / "reference.json").write_text(json.dumps({
      "package": "specforge 0.2.0", "torch": torch.__version__, "transformers": transformers.__version__,
      "target": "qwen3", "token_ids": list(ids), "cases": cases}))
  print(out, sorted(p.name for p in out.iterdir()), [(c["anchor"], c["top1_target"]) for c in cases])


def record_speculators() -> None:
  from speculators import SpeculatorsConfig, VerifierConfig
  from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
  from speculators.proposals.greedy import GreedyTokenProposalConfig
  base, ids = family_target("gemma3")
  c = base.config
  block, vd, indices = 5, 150, [4, 2]
  layer = transformers.Qwen3Config(
      hidden_size=c.hidden_size, intermediate_size=48, num_attention_heads=2, num_key_value_heads=1, head_dim=24,
      num_hidden_layers=1, vocab_size=c.vocab_size, rms_norm_eps=c.rms_norm_eps,
      max_position_embeddings=c.max_position_embeddings, rope_parameters={"rope_type": "default", "rope_theta": 5e4})
  layer._attn_implementation = "eager"
  config = DFlashSpeculatorConfig(
      transformer_layer_config=layer, draft_vocab_size=vd, block_size=block, aux_hidden_state_layer_ids=indices,
      mask_token_id=3, speculators_config=SpeculatorsConfig(
          algorithm="dflash", proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=block - 1)],
          default_proposal_method="greedy", verifier=VerifierConfig(name_or_path=None,
                                                                    architectures=["Gemma3ForCausalLM"])))
  drafter = DFlashDraftModel(config).eval()
  _randomize(drafter)
  d2t, t2d = _draft_vocab(c.vocab_size, vd, seed=7)
  with torch.no_grad():
    drafter.embed_tokens.weight.copy_(base.model.embed_tokens.weight)     # the raw table, as the package loads it
    drafter.load_vocab_mappings(t2d, d2t)
  x = torch.tensor([ids])
  T = x.shape[1]
  loss_mask = torch.zeros(1, T, dtype=torch.long)
  loss_mask[0, ANCHORS] = 1                                                # every valid position becomes an anchor
  with torch.no_grad():
    hs = base(input_ids=x, output_hidden_states=True).hidden_states
    _, logits, _, _, anchors = drafter._backbone_forward(
        torch.cat([hs[i] for i in indices], -1), x, loss_mask, hs[-1], torch.zeros(1, T, dtype=torch.long),
        max_anchors=len(ANCHORS))
  blocks = logits[0].reshape(len(ANCHORS), block, vd)[:, 1:]              # rows 1.. of each block: depths 1..
  assert anchors.reshape(len(ANCHORS), block)[:, 0].tolist() == ANCHORS
  cases = [{"anchor": s, "logits": lg.tolist(), "top1_target": [int(d + d2t[d]) for d in lg.argmax(-1)]}
           for s, lg in zip(ANCHORS, blocks)]
  out = OUT / "speculators"
  drafter.save_pretrained(out)
  for f in out.glob("*.py"):
    f.unlink()
  (out / "reference.json").write_text(json.dumps({
      "package": "speculators 0.9.0", "torch": torch.__version__, "transformers": transformers.__version__,
      "target": "gemma3", "token_ids": list(ids), "cases": cases}))
  print(out, sorted(p.name for p in out.iterdir()), [(c["anchor"], c["top1_target"]) for c in cases])


if __name__ == "__main__":
  {"zlab": record_zlab, "speculators": record_speculators}[sys.argv[1]]()

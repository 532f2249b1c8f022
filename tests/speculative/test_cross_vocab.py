"""Cross-tokenizer drafting (``checkpoints/vocab_map.py``, ``speculative/cross_vocab.py``): the map reads tokens as
bytes across spellings; a draft of another tokenizer gives speculative greedy output equal to plain greedy (chains,
static and dynamic trees), reads the target's context exactly (a draft that is the target in another vocabulary has
every draft accepted), and sampling through it is lossless (chi-square against the enumerated joint, a broken rule
caught)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
from tokenizers import models as tk_models

from specjax.checkpoints import gguf_vocab, vocab_map
from specjax.checkpoints.tokenizer import Tokenizer
from specjax.models import config, decoder as model, kv_cache, sampling
from specjax.speculative import Engine, ModelDrafter, NoDrafter, SpeculativeSampling, cross_vocab, generate
from specjax.speculative.protocol import Drafter
from specjax.speculative.drafters import DynamicShape
from specjax.speculative.trees import specs as tree_shapes
from tests.helpers import TOKENS, gguf_tokenizer
from tests.helpers.lossless import MICRO, N_SAMPLES, SETTINGS, _check, _chi2_pvalue, _exact_joint, _micro_params

BYTE, CONTROL, NORMAL, UNKNOWN = 6, 3, 1, 2


def spm_tokenizer(normal: list[str], add_bos: bool, specials=("<|im_start|>", "<|im_end|>")) -> Tokenizer:
  """A tiny SentencePiece-BPE tokenizer (Gemma's spelling: ▁ for a space, <0xNN> byte pieces, BOS first)."""
  head = ["<unk>", "<s>", "</s>", *specials]
  tokens = head + [f"<0x{b:02X}>" for b in range(256)] + normal
  types = [UNKNOWN] + [CONTROL] * (len(head) - 1) + [BYTE] * 256 + [NORMAL] * len(normal)
  scores = [0.0] * (len(head) + 256) + [-float(i) for i in range(len(normal))]
  hf = gguf_vocab.build_gguf_spm(tokens, scores, types, unk_id=0)
  return Tokenizer(hf, bos_token_id=1, eos_token_ids=[2], chat_template=None, add_bos=add_bos)


def spelled_like_target(extra=()) -> list[str]:
  """Every normal target token (byte-level BPE) that is whole characters, as a SentencePiece piece, shuffled."""
  pieces = []
  for b in vocab_map.token_bytes(gguf_tokenizer(), len(TOKENS)):
    if isinstance(b, bytes):
      try:
        pieces.append(b.decode("utf-8").replace(" ", "▁"))
      except UnicodeDecodeError:
        continue                       # a lone byte >= 0x80: the <0xNN> piece has it
  pieces = sorted(set(pieces), key=len)
  return list(np.random.default_rng(0).permutation(pieces)) + list(extra)


TARGET_TOK = gguf_tokenizer()
FULL = spm_tokenizer(spelled_like_target(extra=("xyz", "▁wo", "rl")), add_bos=False,     # every target token
                     specials=("<|im_start|>", "<|im_end|>", "<|endoftext|>"))
PARTIAL = spm_tokenizer([chr(c) for c in range(ord("a"), ord("z") + 1)] + ["▁", "▁t", "he", "▁the", "ll"],
                        add_bos=True)                                                       # few merges, a BOS
CFG = config.ModelConfig(name="xv-target", vocab_size=len(TOKENS), num_layers=2, d_model=32, num_heads=4,
                         num_kv_heads=2, head_dim=8, ffn_dim=64, max_position=256)
BUCKETS = (32, 64)


def test_the_map_reads_tokens_as_bytes_across_spellings():
  vm = vocab_map.build(TARGET_TOK, FULL)
  t, d = TARGET_TOK.token_to_id, FULL.token_to_id
  pairs = dict(zip(vm.target_ids.tolist(), vm.draft_ids.tolist()))
  assert pairs[t("Ġthe")] == d("▁the") and pairs[t("Ġworld")] == d("▁world") and pairs[t("hello")] == d("hello")
  assert pairs[t("<|im_end|>")] == d("<|im_end|>")           # special tokens by their text
  assert pairs[t("a")] == d("a") != d("<0x61>")              # the piece the draft writes, not its byte piece
  assert pairs[t(vocab_map.BYTE_TO_CHAR[0x80])] == d("<0x80>")   # a lone byte, spelled by GPT-2 and by Gemma
  assert vm.mapped == len(TOKENS) and vm.draft_share < 1 and vm.truncated == 0
  vm = vocab_map.build(TARGET_TOK, PARTIAL)
  pieces = lambda tok: [PARTIAL.hf.id_to_token(int(i)) for i in vm.pieces_VxW[t(tok), :vm.piece_counts_V[t(tok)]]]
  assert pieces("Ġthe") == ["▁the"] and pieces("Ġworld") == ["▁", "w"] and pieces("hello") == ["he", "ll"]
  assert vm.truncated > 0 and vm.draft_bos == 1              # "▁world" is 6 pieces, read as its first 2
  assert t("<|endoftext|>") not in vm.target_ids             # a special the draft does not have: read as text
  assert pieces("<|endoftext|>") == ["<0x3C>", "<0x7C>"]    # "<|", byte pieces (no normal piece has them)
  assert "drafting across tokenizers" in vm.summary("t", "d") and vm.to_dict()["mapped_tokens"] == vm.mapped
  narrow = vocab_map.build(TARGET_TOK, PARTIAL, width=1)      # each target token read as its first piece only
  assert narrow.width == 1 and narrow.pieces_VxW[t("hello"), 0] == PARTIAL.token_to_id("he")


def _translated(target, vm, seed: int, scale: float = 0.3):
  """The target's weights as a draft of another vocabulary: a mapped draft token's embedding (= head row) is its
  target token's; the draft's other tokens random."""
  V, D = vm.draft_vocab, target["embed"].shape[1]
  embed = jax.random.normal(jax.random.PRNGKey(seed), (V, D)) * scale
  embed = embed.at[jnp.asarray(vm.draft_ids)].set(target["embed"][jnp.asarray(vm.target_ids)])
  return {**target, "embed": embed}


def _run(target, drafter, dparams, shape, prompts, lens, max_new):
  B, K = prompts.shape[0], shape.num_nodes if shape is not None else 0
  eng = Engine(cfg=CFG, drafter=drafter, k_max=K, sp=sampling.SamplingParams(), buckets=BUCKETS,
               tree=None if K == 0 else shape)
  st = generate(target, dparams, kv_cache.init_cache(CFG, B, 64), jnp.asarray(prompts), jnp.asarray(lens),
                jnp.asarray(max_new), jnp.full((B,), K, jnp.int32), jax.random.PRNGKey(0), engine=eng)
  seq = np.asarray(st.seq_BxS)
  return [seq[i, lens[i]:lens[i] + int(st.num_new_B[i])].tolist() for i in range(B)], st.stats


def _tau(stats) -> float:
  return int(stats.committed_B.sum()) / int(stats.verify_steps_B.sum())


PROMPTS = np.array([[1, 40, 77, 100, 5, 200, 263, 7], [264, 265, 269, 0, 0, 0, 0, 0]], np.int32)
LENS = np.array([8, 3])
SHAPES = {"chain4": tree_shapes.chain(4), "tree": tree_shapes.branching([2, 2, 1]),
          "dynamic": DynamicShape(6, top_k=2, max_depth=3)}


@pytest.fixture(scope="module")
def target():
  return model.init_params(CFG, jax.random.PRNGKey(3))


@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_greedy_output_equals_plain_greedy(target, shape):
  max_new = np.array([24, 19], np.int32)
  base, _ = _run(target, NoDrafter(), (), None, PROMPTS, LENS, max_new)
  for draft_tok, seed in ((FULL, 1), (PARTIAL, 2)):
    vm = vocab_map.build(TARGET_TOK, draft_tok)
    dcfg = CFG.replace(name=f"xv-draft{seed}", vocab_size=vm.draft_vocab)
    drafter, dparams = cross_vocab.build(dcfg, _translated(target, vm, seed), vm, CFG, BUCKETS)
    assert isinstance(drafter, Drafter)
    hash(drafter)                                            # a jit static argument (through Engine)
    out, stats = _run(target, drafter, dparams, SHAPES[shape], PROMPTS, LENS, max_new)
    assert out == base, (shape, dcfg.name)
    accepted, drafted = int(stats.accepted_B.sum()), int(stats.drafted_B.sum())
    if draft_tok is FULL:
      # The target in another vocabulary reads the same context at the same positions: it drafts as the target
      # drafting for itself (same tokenizer), whose first choices are all accepted.
      _, self_stats = _run(target, ModelDrafter(CFG, buckets=BUCKETS), target, SHAPES[shape], PROMPTS, LENS,
                           max_new)
      assert int(stats.accepted_B.sum()) == int(self_stats.accepted_B.sum()), shape
      assert _tau(stats) >= SHAPES[shape].max_depth + 1 - 0.5 or shape == "dynamic", _tau(stats)
    else:
      assert accepted > 0, shape


def test_a_draft_cache_in_its_own_spelling_stays_in_step(target):
  """After a step the draft's cache holds the pieces of every target token but the pending leaf (+ BOS)."""
  vm = vocab_map.build(TARGET_TOK, PARTIAL)
  dcfg = CFG.replace(name="xv-partial", vocab_size=vm.draft_vocab)
  drafter, dparams = cross_vocab.build(dcfg, _translated(target, vm, 2), vm, CFG, BUCKETS)
  eng = Engine(cfg=CFG, drafter=drafter, k_max=3, sp=sampling.SamplingParams(), buckets=BUCKETS)
  from specjax.speculative import engine as engine_lib
  st = engine_lib.init(eng, target, dparams, kv_cache.init_cache(CFG, 2, 64), jnp.asarray(PROMPTS),
                       jnp.asarray(LENS), jnp.full((2,), 20), jax.random.PRNGKey(0))
  counts = np.asarray(vm.piece_counts_V)
  want = [1 + counts[PROMPTS[b, :LENS[b]]].sum() for b in range(2)]
  assert np.asarray(st.draft.cache.lengths).tolist() == want
  for _ in range(3):
    st = engine_lib.spec_step(eng, target, dparams, st, jnp.full((2,), 3, jnp.int32))
    seq, lengths = np.asarray(st.seq_BxS), np.asarray(st.cache.lengths)
    pending = np.asarray(st.draft.pending_B)
    for b in range(2):
      read = seq[b, :lengths[b] - int(pending[b])]       # the root (at lengths) and a pending leaf: not yet
      assert int(st.draft.cache.lengths[b]) == 1 + counts[read].sum()


# --- sampling: a micro target (12 tokens) and a micro draft of another plain-text vocabulary (10 tokens) ---

MICRO_TARGET = ["a", "b", "c", "d", "e", "f", "ab", "cd", "ef", "abc", "de", "fa"]
MICRO_DRAFT = ["<s>", "f", "e", "d", "c", "b", "a", "ba", "cd", "cde"]


def _plain_tokenizer(tokens, merges, bos=None) -> Tokenizer:
  hf = tokenizers.Tokenizer(tk_models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
  if bos is not None:
    hf.add_special_tokens([tokenizers.AddedToken(bos, special=True)])
  return Tokenizer(hf, bos_token_id=None if bos is None else 0, eos_token_ids=[], chat_template=None,
                   add_bos=bos is not None)


@pytest.fixture(scope="module")
def micro_map():
  target = _plain_tokenizer(MICRO_TARGET, [("a", "b"), ("c", "d"), ("e", "f"), ("ab", "c"), ("d", "e"), ("f", "a")])
  draft = _plain_tokenizer(MICRO_DRAFT, [("b", "a"), ("c", "d"), ("cd", "e")], bos="<s>")
  vm = vocab_map.build(target, draft)
  # a..f and cd map; "ab" "ef" "de" "fa" are read as 2 pieces, "abc" as its first 2 of 3
  assert vm.mapped == 7 and vm.draft_bos == 0 and vm.truncated == 1
  return vm


MICRO_DRAFT_CFG = MICRO.replace(name="micro-xv", vocab_size=len(MICRO_DRAFT))


@pytest.fixture(scope="module")
def micro_pair(micro_map):
  """Target seed 6; a draft of the other vocabulary, seed 7, sharpened 6x (confident, often wrong: the rules
  differ a lot)."""
  d = _micro_params(7, MICRO_DRAFT_CFG)
  return _micro_params(6), cross_vocab.build(MICRO_DRAFT_CFG, {**d, "embed": d["embed"] * 6}, micro_map, MICRO)[1]


def _micro_drafter(micro_map):
  return lambda name="model": cross_vocab.CrossVocabDrafter(MICRO_DRAFT_CFG, name=name, width=micro_map.width,
                                                             draft_bos=micro_map.draft_bos)


def test_sampling_through_a_chain_is_lossless(micro_pair, micro_map):
  from tests.helpers.lossless import _spec_samples
  target, dparams = micro_pair
  sp = sampling.SamplingParams(temperature=1.0)
  joint = _exact_joint(target, sp)
  drafter = _micro_drafter(micro_map)()
  p_right = _chi2_pvalue(_spec_samples(target, dparams, sp, drafter=drafter), joint)
  p_broken = _chi2_pvalue(_spec_samples(target, dparams, sp, drafter=drafter,
                                        acceptance=SpeculativeSampling(residual_update=False)), joint)
  print(f"cross-vocab chain: p = {p_right:.3g} (the rule), {p_broken:.3g} (no residual)")
  assert p_right > 1e-3, p_right
  assert p_broken < 1e-6, p_broken
  assert N_SAMPLES >= 20_000


def test_sampling_through_a_static_tree_is_lossless(micro_pair, micro_map, monkeypatch):
  _check(*micro_pair, SETTINGS[0], tree_shapes.branching([3, 2]), _micro_drafter(micro_map), monkeypatch)


def test_sampling_through_a_dynamic_tree_is_lossless(micro_pair, micro_map, monkeypatch):
  _check(*micro_pair, SETTINGS[1], DynamicShape(8, top_k=3, max_depth=2), _micro_drafter(micro_map), monkeypatch)

"""Token trees on device: the data a speculative step drafts, verifies and reads back.

A tree has a static node budget: N1 = N + 1 slots per sequence.  Node 0 is the root (the newest committed
token, not yet in any cache); nodes 1..N are drafts.  The drafter fills per sequence

  tokens_BxN1    node tokens (tokens[:, 0] = the root)
  parents_BxN1   parent index, < the node's own (-1 for the root); nodes in BFS order
  valid_BxN1     which draft slots hold a node (an n-gram trie may fill fewer than N; k_active and the
                 buffer's room mask more)

and ``build`` derives on device, so a tree whose shape changes every iteration compiles nothing:

  depth_BxN1        0 at the root
  anc_BxN1xN1       anc[b, i, j]: j is i or an ancestor of i — the verification's attention mask over the
                    tree region (a bool [N1, N1] per sequence: at N1 ≤ 65 a packed-bit form would save
                    nothing measurable next to one [N1, V] logits row)
  positions         committed length + depth (``positions``)

Node i's K/V are written at slot lengths + i.  After acceptance the accepted root-to-leaf path
(``path_nodes``) is moved to the contiguous slots lengths + d (``kv_cache.compact``).

The acceptance rules over a tree (``accept_greedy``, ``accept_sampling``) generalise the chain's: a chain of
k drafts is the tree whose parents are 0, 1, ..., k-1.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import struct

from specjax.models import sampling, sampling_rows


@struct.dataclass
class Tree:
  tokens_BxN1: jax.Array
  parents_BxN1: jax.Array
  valid_BxN1: jax.Array
  depth_BxN1: jax.Array
  anc_BxN1xN1: jax.Array

  @property
  def num_slots(self) -> int:   # N1
    return self.tokens_BxN1.shape[1]


def build(tokens_BxN1: jax.Array, parents_BxN1: jax.Array, valid_BxN1: jax.Array) -> Tree:
  """Depths and ancestor masks from parents, by pointer doubling (log2 N1 boolean matrix products).  A node
  whose ancestor is not valid is not valid either; the root always is."""
  B, N1 = parents_BxN1.shape
  has_parent = parents_BxN1 >= 0
  up = jax.nn.one_hot(jnp.maximum(parents_BxN1, 0), N1, dtype=jnp.int32) * has_parent[..., None].astype(jnp.int32)
  anc = jnp.eye(N1, dtype=jnp.int32)[None] + up                       # self and parent
  for _ in range(max(1, math.ceil(math.log2(max(N1, 2))))):          # reach doubles each round
    anc = jnp.minimum(anc + jnp.einsum("bij,bjk->bik", anc, anc), 1)
  anc = anc.astype(bool)
  valid = valid_BxN1.at[:, 0].set(True)
  valid = ~jnp.any(anc & ~valid[:, None, :], axis=-1)                # every ancestor valid
  depth = jnp.sum(anc, axis=-1).astype(jnp.int32) - 1
  return Tree(tokens_BxN1=tokens_BxN1.astype(jnp.int32), parents_BxN1=parents_BxN1.astype(jnp.int32),
              valid_BxN1=valid, depth_BxN1=depth, anc_BxN1xN1=anc)


def positions(tree: Tree, lengths_B: jax.Array) -> jax.Array:
  """RoPE positions of the nodes: committed length + depth."""
  return lengths_B[:, None] + tree.depth_BxN1


def region_mask(tree: Tree) -> jax.Array:
  """[B, N1, N1]: what node i may see of the tree region (its valid ancestors and itself)."""
  return tree.anc_BxN1xN1 & tree.valid_BxN1[:, None, :]


def path_nodes(tree: Tree, leaf_B: jax.Array, D: int) -> jax.Array:
  """[B, D+1]: the node at each depth on the root-to-leaf path (-1 past the leaf's depth)."""
  B, N1 = tree.parents_BxN1.shape
  on_path = jnp.take_along_axis(tree.anc_BxN1xN1, leaf_B[:, None, None], axis=1)[:, 0]     # [B, N1]
  at = jnp.where(on_path, tree.depth_BxN1, D + 1)
  out = jnp.full((B, D + 1), -1, jnp.int32)
  return out.at[jnp.arange(B)[:, None], at].set(jnp.broadcast_to(jnp.arange(N1), (B, N1)), mode="drop")


def has_child(tree: Tree) -> jax.Array:
  """[B, N1]: the node has at least one valid child."""
  N1 = tree.num_slots
  is_child_of = (tree.parents_BxN1[:, :, None] == jnp.arange(N1)[None, None, :]) & tree.valid_BxN1[..., None]
  return jnp.any(is_child_of, axis=1)


# ----------------------------------------------------------------------------------------------------------
# Acceptance over a tree


class TreeAcceptance(NamedTuple):
  leaf_B: jax.Array          # the deepest accepted node (0: nothing accepted)
  next_token_B: jax.Array    # the correction or bonus token that follows the leaf
  accepted_BxN1: jax.Array   # nodes on the accepted path (root included)


def accept_greedy(tree: Tree, target_logits_BxN1xV: jax.Array) -> TreeAcceptance:
  """The longest root path whose every node equals the target's argmax after its parent (lowest index on a
  tie); the target's argmax after that leaf follows.  Output identical to greedy decoding."""
  return accept_given(tree, jnp.argmax(target_logits_BxN1xV, axis=-1).astype(jnp.int32))


def accept_given(tree: Tree, best_BxN1: jax.Array) -> TreeAcceptance:
  """``accept_greedy`` with the token that follows each node given (``best_BxN1``): the target's argmax, or the
  known output at the node's position (offline replay)."""
  best = best_BxN1.astype(jnp.int32)
  after_parent = jnp.take_along_axis(best, jnp.maximum(tree.parents_BxN1, 0), axis=1)
  ok = tree.valid_BxN1 & (tree.tokens_BxN1 == after_parent)
  ok = ok.at[:, 0].set(True)
  on_good_path = ~jnp.any(tree.anc_BxN1xN1 & ~ok[:, None, :], axis=-1)
  leaf = jnp.argmax(jnp.where(on_good_path, tree.depth_BxN1, -1), axis=-1).astype(jnp.int32)
  nxt = jnp.take_along_axis(best, leaf[:, None], axis=1)[:, 0]
  accepted = jnp.take_along_axis(tree.anc_BxN1xN1, leaf[:, None, None], axis=1)[:, 0]
  return TreeAcceptance(leaf, nxt, accepted)


def _normalise(x_BxV):
  mass = jnp.sum(x_BxV, axis=-1, keepdims=True)
  return x_BxV / jnp.where(mass > 0, mass, 1.0), mass[:, 0] > 0


def accept_sampling(tree: Tree, target_logits_BxN1xV: jax.Array, q_BxN1xV: jax.Array | None, key: jax.Array,
                    sp: sampling.SamplingParams, without_replacement: bool = True,
                    residual_update: bool = True) -> TreeAcceptance:
  """Recursive rejection sampling over siblings (SpecInfer, SpecTr, Sequoia): lossless for any tree.

  From the root, try the current node's children in index order: child x is accepted with probability
  min(1, p(x) / q(x)) — then it becomes the current node, p its target distribution — and on rejection
  p ← normalise(max(0, p − q)).  Siblings drawn without replacement (``without_replacement``) also remove x
  from q and renormalise it.  When no child is accepted the next token comes from p: the residual after a
  rejection, the target's own distribution (the bonus token) at a leaf.

  ``q_BxN1xV[b, i]`` is the distribution node i's children were drawn from (the filtered draft distribution);
  ``None`` means deterministic children (an n-gram trie, top-k choices): each child is its own point mass,
  accepted with probability p(x), and a rejection removes x from p.  ``residual_update=False`` is a
  deliberately wrong rule (rejections leave p alone), kept so tests can show they catch it.  Children must
  have been drawn from q (a filler child q gives no mass must come in invalid: ``sample_children``).

  One scan over the nodes in index order: node i is a candidate exactly when its parent is the current node
  and it is valid (parents precede children, so a node's children are all tried after it is reached).
  """
  B, N1, V = target_logits_BxN1xV.shape
  p_all = sampling.probs(target_logits_BxN1xV, sp)             # [B, N1, V]; a greedy row's is one-hot
  key_u, key_s = sampling_rows.split(key, 2)                     # one key, or one per row (per-row sampling)
  u_BxN1 = sampling_rows.uniform(key_u, (B, N1))
  deterministic = q_BxN1xV is None
  rows = jnp.arange(B)

  def body(carry, xs):
    cur, p, q = carry
    i, tok, par, ok, u, p_i, q_i = xs
    candidate = ok & (par == cur)
    p_x = p[rows, tok]
    if deterministic:
      q_x, q_now = jnp.ones_like(p_x), jax.nn.one_hot(tok, V, dtype=p.dtype)
    else:
      q_x, q_now = q[rows, tok], q
    accept = candidate & (u * q_x < p_x)                           # u < p/q without dividing by q
    reject = candidate & ~accept
    if residual_update:
      res, has_mass = _normalise(jnp.maximum(p - q_now, 0.0))
      p_rej = jnp.where(has_mass[:, None], res, p)
    else:
      p_rej = p
    q_rej = q
    if not deterministic and without_replacement:
      q_rej, has_mass = _normalise(q.at[rows, tok].set(0.0))
      q_rej = jnp.where(has_mass[:, None], q_rej, q)
    p = jnp.where(accept[:, None], p_i, jnp.where(reject[:, None], p_rej, p))
    if not deterministic:
      q = jnp.where(accept[:, None], q_i, jnp.where(reject[:, None], q_rej, q))
    return (jnp.where(accept, i, cur), p, q), accept

  xs = (jnp.arange(1, N1, dtype=jnp.int32), tree.tokens_BxN1[:, 1:].T, tree.parents_BxN1[:, 1:].T,
        tree.valid_BxN1[:, 1:].T, u_BxN1[:, 1:].T, jnp.swapaxes(p_all[:, 1:], 0, 1),
        None if deterministic else jnp.swapaxes(q_BxN1xV[:, 1:], 0, 1))   # point masses carry no q
  init = (jnp.zeros((B,), jnp.int32), p_all[:, 0], None if deterministic else q_BxN1xV[:, 0])
  (leaf, p, _), _ = jax.lax.scan(body, init, xs)
  logits = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf)
  nxt = sampling_rows.categorical(key_s, logits)
  accepted = jnp.take_along_axis(tree.anc_BxN1xN1, leaf[:, None, None], axis=1)[:, 0]
  return TreeAcceptance(leaf, nxt, accepted)


@struct.dataclass
class ForcedChain:
  """Sampling settings under which a chain's drafts are given rather than drawn (offline replay,
  ``speculative/replay.py``): the drafter computes every depth's distribution q exactly as when sampling with
  ``temperature`` / ``top_k`` / ``top_p``, but its draft at depth d is ``tokens_BxD[:, d - 1]``, so q along a
  known output can be read off.  Duck-types ``SamplingParams``; the tokens are data."""
  tokens_BxD: jax.Array
  temperature: float = struct.field(pytree_node=False, default=1.0)
  top_k: int = struct.field(pytree_node=False, default=0)
  top_p: float = struct.field(pytree_node=False, default=1.0)

  @property
  def greedy(self) -> bool:
    return False

  def at_depth(self, d: int, chosen_BxWxK: jax.Array) -> jax.Array:
    """The given draft at depth ``d`` in place of the drawn one (a chain: W = K = 1)."""
    return jnp.broadcast_to(self.tokens_BxD[:, d - 1, None, None], chosen_BxWxK.shape).astype(jnp.int32)


def sample_children(key: jax.Array, logits_BxWxV: jax.Array, K: int, sp: sampling.SamplingParams):
  """K children per row: the top K tokens (greedy), or K tokens drawn without replacement from the filtered
  distribution by the Gumbel top-k trick (sampling).  Returns (tokens [B, W, K], q [B, W, V] or None,
  drawn [B, W, K]): when the filtered q has fewer than K tokens with mass (top-k or top-p narrower than the
  tree), the remaining children are filler that was never drawn (``drawn`` False): they must not be offered
  for acceptance.

  Per-row settings (``sampling_rows.RowSampling``, ``key`` one per row): a greedy row takes its top K, as a
  greedy engine does, and offers them all; its q (the draft softmax) only has to be a distribution, since
  its one-hot p accepts exactly the argmax whatever q is."""
  if sp.greedy:
    tokens = jax.lax.top_k(logits_BxWxV, K)[1].astype(jnp.int32)
    return tokens, None, jnp.ones(tokens.shape, bool)
  filt = sampling.filtered_logits(logits_BxWxV, sp)
  q = jax.nn.softmax(filt, axis=-1)
  gumbel = sampling_rows.gumbel(key, filt.shape)
  scores = jnp.where(q > 0, jnp.log(jnp.maximum(q, 1e-38)) + gumbel, -jnp.inf)
  if isinstance(sp, sampling_rows.RowSampling):
    greedy = sp.greedy_B.reshape((-1,) + (1,) * (scores.ndim - 1))
    scores = jnp.where(greedy, logits_BxWxV.astype(jnp.float32), scores)
    best, tokens = jax.lax.top_k(scores, K)
    return tokens.astype(jnp.int32), q, greedy | (best > -jnp.inf)
  best, tokens = jax.lax.top_k(scores, K)
  return tokens.astype(jnp.int32), q, best > -jnp.inf

"""Tree attention over a layered KV cache: a Pallas kernel and its pure-JAX reference.

Contract (both functions).  ``q_BxTxHxE`` holds T new query rows per sequence; the KV buffer is
``[L, B, S, K, E]`` (L layers, S slots, K kv heads, E head dim) and ``layer`` a traced int32 scalar selects
the layer.  Query heads H = K * G; query head h reads kv head h // G.  Query t of sequence b attends to

  * every committed slot j < lengths[b] (the prefix), and
  * the tree slots lengths[b] + u, u in [0, U), for which ``mask_BxTxU[b, t, u]`` is True.

Nothing else: there is no implicit causal rule, the mask says it all.  A layer with a sliding window also
gives ``lo_BxT``, each query's first visible slot: slots before it are unseen, and prefix blocks wholly before
every row's start are not read (the work of a windowed layer does not grow with the context).  Scores are
scaled by 1/sqrt(E) (then capped c·tanh(s / c) with ``softcap``), the softmax runs in float32, the output is [B, T, H, E] in q's dtype.  A row that sees no slot (lengths[b] == 0
and an all-False mask row) comes out zero, never NaN.  Slots at or past min(S, lengths[b] + U) are
irrelevant: the kernel never reads a KV block that starts past lengths[b] + U.

The kernel (flash decoding).  One program per (sequence b, kv head k); the G query heads sharing kv head k
are packed into one [T*G, E] query tile (row r = t*G + g, rows padded for the platform).  A
``lax.fori_loop`` with a data-dependent trip count cdiv(lengths[b], block_kv) walks the prefix blocks,
loading each by dynamic slice from the full buffer ref; the only test there is j < lengths[b] (the last
block's start is clamped to S - block_kv so nothing is read out of bounds, and its slots before the nominal
start are masked by absolute index).  Then one tree tile of U' >= U slots starting at lengths[b] (clamped to
S - U') is masked by the tree mask, shifted by the clamp with a one-hot matmul.  Online softmax and all
accumulation in float32 (bf16 tiles are upcast after loading).  The last block / tree tile may cover a few
dead slots (past lengths[b] + U); their value rows are zeroed by a select before p @ v, so garbage or NaN
there cannot leak.  Known limit on all platforms: one program per (b, kv head), no split of the KV loop
across programs, so a small B * K underfills a large GPU on long prefixes.

Lowering (``variant``):

  * ``"triton"`` (GPU, the default off TPU and in CPU interpret mode): a Triton-backed ``pl.pallas_call``
    (chosen over Mosaic GPU because Triton runs on every CUDA GPU from Ampere on and on ROCm, supports
    pointer-style dynamic slicing of the whole buffer, and needs no warpgroup-level code; Mosaic GPU is
    Hopper+ only).  Triton wants power-of-two array sizes and dot dims >= 16, so the query tile is padded to
    max(16, 2^ceil(log2(T*G))) rows, the tree tile to max(16, 2^ceil(log2 U)) slots, block_kv is rounded
    down to a power of two <= S, and E must be a power of two >= 16 (checked; k/v are read in place, not
    padded).  fp32 dots use Precision.HIGHEST (IEEE, not TF32).  lengths/layer are read from global memory.
  * ``"mosaic_tpu"`` (TPU): lengths and layer are scalar-prefetched into SMEM, k/v stay in HBM (pl.ANY)
    and each block is fetched with a synchronous DMA into a VMEM scratch.  Tiles are padded to multiples
    of 8 rows.  Known limits: no double buffering (DMA and compute do not overlap); the per-head DMA is
    strided over the (K, E) tiled dims, and this path lowers to Mosaic MLIR but has not been compiled or
    run on a TPU here.

``interpret=None`` means interpret mode exactly when ``jax.default_backend() == "cpu"``.

Dispatch rule (``attention_path``, written down once in ``specjax.kernels.dispatch``): on the CPU the native C++ kernel
``specjax.kernels.cpu_attention`` ("native", when it applies; the caller, which knows T and the dtypes,
falls back to "xla" otherwise), on GPU and TPU this Pallas kernel ("pallas"), anywhere else the XLA
reference ("xla").  The environment variable ``SPECJAX_ATTENTION=native|pallas|xla`` forces a path.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from specjax.kernels import dispatch

ATTENTION_ENV = "SPECJAX_ATTENTION"
ATTENTION_PATHS = dispatch.ATTENTION_PATHS
VARIANTS = ("triton", "mosaic_tpu")

_NEG_BIG = -1e30  # running-max floor: keeps exp(m_old - m_new) finite for rows that see nothing yet


def attention_path(platform: str | None = None) -> str:
  """"native" | "pallas" | "xla" for ``platform``: the rule in ``specjax.kernels.dispatch``."""
  return dispatch.platform_attention(platform)


def tree_attention_reference(q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU, lo_BxT=None,
                             softcap=None):
  """Plain-XLA reference of the contract above: [B, T, H, E] in q's dtype."""
  B, T, H, E = q_BxTxHxE.shape
  S, K = k_LxBxSxKxE.shape[2], k_LxBxSxKxE.shape[3]
  U = mask_BxTxU.shape[2]
  hi = lax.Precision.HIGHEST
  k_BxSxKxE = lax.dynamic_index_in_dim(k_LxBxSxKxE, layer, 0, keepdims=False).astype(jnp.float32)
  v_BxSxKxE = lax.dynamic_index_in_dim(v_LxBxSxKxE, layer, 0, keepdims=False).astype(jnp.float32)
  q_BxTxKxGxE = q_BxTxHxE.reshape(B, T, K, H // K, E).astype(jnp.float32)
  s_BxTxKxGxS = jnp.einsum("btkge,bske->btkgs", q_BxTxKxGxE, k_BxSxKxE, precision=hi) / math.sqrt(E)
  if softcap is not None:
    s_BxTxKxGxS = softcap * jnp.tanh(s_BxTxKxGxS / softcap)
  # Slot j is visible to (b, t) if committed, or a tree slot the mask allows.
  rel_Bx1xS = jnp.arange(S)[None, None, :] - lengths_B.astype(jnp.int32)[:, None, None]
  idx_BxTxS = jnp.broadcast_to(jnp.clip(rel_Bx1xS, 0, U - 1), (B, T, S))
  tree_BxTxS = (rel_Bx1xS >= 0) & (rel_Bx1xS < U) & jnp.take_along_axis(mask_BxTxU, idx_BxTxS, axis=2)
  vis_BxTxS = (rel_Bx1xS < 0) | tree_BxTxS
  if lo_BxT is not None:
    vis_BxTxS = vis_BxTxS & (jnp.arange(S)[None, None, :] >= lo_BxT[:, :, None])
  vis_BxTx1x1xS = vis_BxTxS[:, :, None, None, :]
  s_BxTxKxGxS = jnp.where(vis_BxTx1x1xS, s_BxTxKxGxS, -jnp.inf)
  m = jnp.max(s_BxTxKxGxS, axis=-1, keepdims=True)
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p_BxTxKxGxS = jnp.where(vis_BxTx1x1xS, jnp.exp(s_BxTxKxGxS - m), 0.0)
  l = jnp.sum(p_BxTxKxGxS, axis=-1, keepdims=True)
  o_BxTxKxGxE = jnp.einsum("btkgs,bske->btkge", p_BxTxKxGxS, v_BxSxKxE, precision=hi)
  o_BxTxKxGxE = jnp.where(l > 0, o_BxTxKxGxE / jnp.where(l > 0, l, 1.0), 0.0)
  return o_BxTxKxGxE.reshape(B, T, H, E).astype(q_BxTxHxE.dtype)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _pow2_ceil(x: int) -> int:
  return 1 << max(0, (x - 1).bit_length())


def _pow2_floor(x: int) -> int:
  return 1 << (x.bit_length() - 1)


def _tiles(variant: str, R: int, U: int, S: int, E: int, block_kv: int, interpret: bool):
  """(query rows R', tree slots U', block_kv) as the platform needs them."""
  if variant == "triton":
    if not interpret and (E < 16 or E & (E - 1)):
      raise ValueError(f"the Triton tree-attention kernel needs a power-of-two head dim >= 16, got E={E}")
    Rp, Up, bkv = max(16, _pow2_ceil(R)), max(16, _pow2_ceil(U)), _pow2_floor(min(max(block_kv, 16), S))
  else:
    Rp, Up, bkv = _round_up(R, 8), _round_up(U, 8), min(_round_up(block_kv, 8), S // 8 * 8)
  if Up > S or bkv < 1:
    raise ValueError(f"cache of S={S} slots too small for tree tile {Up} / kv block {block_kv} ({variant})")
  return Rp, Up, bkv


def _dot_nt(a_MxE, b_NxE):
  """a @ b.T in float32 (IEEE on GPU, full precision on TPU)."""
  return lax.dot_general(a_MxE, b_NxE, (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def _dot_nn(a_MxN, b_NxE):
  return lax.dot_general(a_MxN, b_NxE, (((1,), (0,)), ((), ())), precision=lax.Precision.HIGHEST,
                         preferred_element_type=jnp.float32)


def _attend_tile(q_RxE, mask_RxU, lo_R, length, load_kv, *, S: int, U: int, bkv: int, Up: int, scale: float,
                 softcap: float | None):
  """[R, E] float32 attention of one packed query tile; ``load_kv(start, n)`` -> (k [n, E], v [n, E])."""
  R, E = q_RxE.shape
  q_RxE = q_RxE.astype(jnp.float32) * scale
  lo_Rx1 = lo_R.reshape(R, 1)

  def update(carry, k_NxE, v_NxE, see_RxN, live_Nx1):
    m_Rx1, l_Rx1, acc_RxE = carry
    v_NxE = jnp.where(live_Nx1, v_NxE.astype(jnp.float32), 0.0)  # a NaN in a dead slot stays out
    s_RxN = _dot_nt(q_RxE, k_NxE.astype(jnp.float32))
    if softcap is not None:
      s_RxN = softcap * jnp.tanh(s_RxN / softcap)
    s_RxN = jnp.where(see_RxN, s_RxN, -jnp.inf)
    m_new = jnp.maximum(m_Rx1, jnp.max(s_RxN, axis=1, keepdims=True))
    alpha_Rx1 = jnp.exp(m_Rx1 - m_new)
    p_RxN = jnp.exp(s_RxN - m_new)
    l_new = alpha_Rx1 * l_Rx1 + jnp.sum(p_RxN, axis=1, keepdims=True)
    return m_new, l_new, alpha_Rx1 * acc_RxE + _dot_nn(p_RxN, v_NxE)

  carry = (jnp.full((R, 1), _NEG_BIG, jnp.float32), jnp.zeros((R, 1), jnp.float32),
           jnp.zeros((R, E), jnp.float32))

  # Prefix: blocks of bkv slots up to lengths[b], from the block holding the earliest row's window start;
  # the last start is clamped to S - bkv (in bounds).
  def prefix_block(i, carry):
    first = i * bkv
    start = jnp.minimum(first, S - bkv)
    k_NxE, v_NxE = load_kv(start, bkv)
    j_1xN = start + lax.broadcasted_iota(jnp.int32, (1, bkv), 1)
    j_Nx1 = start + lax.broadcasted_iota(jnp.int32, (bkv, 1), 0)
    see_RxN = (j_1xN >= first) & (j_1xN < length) & (j_1xN >= lo_Rx1)
    live_Nx1 = (j_Nx1 >= first) & (j_Nx1 < length)
    return update(carry, k_NxE, v_NxE, see_RxN, live_Nx1)

  first_block = lax.div(jnp.clip(jnp.min(lo_R), 0, S), bkv)
  carry = lax.fori_loop(first_block, lax.div(length + (bkv - 1), bkv), prefix_block, carry)  # lengths >= 0

  # Tree tile: Up slots from lengths[b], clamped to S - Up; tile column i is tree slot u = i - d.
  start = jnp.minimum(length, S - Up)
  d = length - start
  k_NxE, v_NxE = load_kv(start, Up)
  u_UxN = lax.broadcasted_iota(jnp.int32, (Up, Up), 0)
  i_UxN = lax.broadcasted_iota(jnp.int32, (Up, Up), 1)
  shift_UxN = (i_UxN == u_UxN + d).astype(jnp.float32)
  i_1xN = lax.broadcasted_iota(jnp.int32, (1, Up), 1)
  see_RxN = (_dot_nn((mask_RxU != 0).astype(jnp.float32), shift_UxN) > 0.5) & (start + i_1xN >= lo_Rx1)
  i_Nx1 = lax.broadcasted_iota(jnp.int32, (Up, 1), 0)
  live_Nx1 = (i_Nx1 >= d) & (i_Nx1 < d + U)
  m_Rx1, l_Rx1, acc_RxE = update(carry, k_NxE, v_NxE, see_RxN, live_Nx1)
  return jnp.where(l_Rx1 > 0, acc_RxE / jnp.where(l_Rx1 > 0, l_Rx1, 1.0), 0.0)


def _triton_kernel(layer_ref, lengths_ref, q_ref, mask_ref, lo_ref, k_ref, v_ref, o_ref, **kw):
  b, h = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[0]

  def load_kv(start, n):
    return k_ref[layer, b, pl.ds(start, n), h, :], v_ref[layer, b, pl.ds(start, n), h, :]

  o_ref[...] = _attend_tile(q_ref[...], mask_ref[...], lo_ref[...], lengths_ref[b], load_kv,
                            **kw).astype(o_ref.dtype)


def _tpu_kernel(layer_ref, lengths_ref, q_ref, mask_ref, lo_ref, k_hbm, v_hbm, o_ref, kb, vb, kt, vt, **kw):
  from jax.experimental.pallas import tpu as pltpu
  b, h = pl.program_id(0), pl.program_id(1)
  layer = layer_ref[0]

  def load_kv(start, n):
    k_buf, v_buf = (kb, vb) if n == kw["bkv"] else (kt, vt)
    pltpu.sync_copy(k_hbm.at[layer, b, pl.ds(start, n), h], k_buf)
    pltpu.sync_copy(v_hbm.at[layer, b, pl.ds(start, n), h], v_buf)
    return k_buf[...], v_buf[...]

  o_ref[...] = _attend_tile(q_ref[...], mask_ref[...], lo_ref[...], lengths_ref[b], load_kv,
                            **kw).astype(o_ref.dtype)


def tree_attention(q_BxTxHxE, k_LxBxSxKxE, v_LxBxSxKxE, layer, lengths_B, mask_BxTxU, lo_BxT=None, *,
                   softcap: float | None = None, block_kv: int = 128, interpret: bool | None = None,
                   variant: str | None = None):
  """The Pallas kernel: same contract and result as ``tree_attention_reference``.

  ``variant``: "triton" (GPU) or "mosaic_tpu"; default "mosaic_tpu" on a TPU backend, else "triton" (also
  what CPU interpret mode runs).  ``interpret=None``: interpret exactly on the CPU backend."""
  B, T, H, E = q_BxTxHxE.shape
  _, _, S, K, _ = k_LxBxSxKxE.shape
  U = mask_BxTxU.shape[2]
  G = H // K
  R = T * G
  backend = jax.default_backend()
  interpret = backend == "cpu" if interpret is None else interpret
  variant = variant or ("mosaic_tpu" if backend == "tpu" else "triton")
  if variant not in VARIANTS:
    raise ValueError(f"variant={variant!r}: allowed values are {', '.join(VARIANTS)}")
  Rp, Up, bkv = _tiles(variant, R, U, S, E, block_kv, interpret)

  # Pack the G query heads of each kv head into one tile: [B, K, R', E], row r = t*G + g.
  q_BxKxRxE = q_BxTxHxE.reshape(B, T, K, G, E).transpose(0, 2, 1, 3, 4).reshape(B, K, R, E)
  q_BxKxRxE = jnp.pad(q_BxKxRxE, ((0, 0), (0, 0), (0, Rp - R), (0, 0)))
  mask_BxRxU = jnp.repeat(mask_BxTxU.astype(jnp.int32), G, axis=1)
  mask_BxRxU = jnp.pad(mask_BxRxU, ((0, 0), (0, Rp - R), (0, Up - U)))
  layer_1 = jnp.asarray(layer, jnp.int32).reshape(1)
  lengths_B = jnp.clip(lengths_B.astype(jnp.int32), 0, S)
  # Each packed row's window start (padding rows start past the buffer, so they do not hold the loop back).
  lo_BxT = jnp.zeros((B, T), jnp.int32) if lo_BxT is None else lo_BxT.astype(jnp.int32)
  lo_BxRx1 = jnp.pad(jnp.repeat(lo_BxT, G, axis=1), ((0, 0), (0, Rp - R)), constant_values=S)[:, :, None]

  kw = dict(S=S, U=U, bkv=bkv, Up=Up, scale=1.0 / math.sqrt(E), softcap=softcap)
  out_shape = jax.ShapeDtypeStruct((B, K, Rp, E), q_BxTxHxE.dtype)
  if variant == "triton":
    from jax.experimental.pallas import triton as plgpu
    whole = pl.no_block_spec  # the full array, indexed in place (a pointer on Triton)
    o_BxKxRxE = pl.pallas_call(
        functools.partial(_triton_kernel, **kw), out_shape=out_shape, grid=(B, K),
        in_specs=[whole, whole,
                  pl.BlockSpec((None, None, Rp, E), lambda b, h: (b, h, 0, 0)),
                  pl.BlockSpec((None, Rp, Up), lambda b, h: (b, 0, 0)),
                  pl.BlockSpec((None, Rp, 1), lambda b, h: (b, 0, 0)),
                  whole, whole],
        out_specs=pl.BlockSpec((None, None, Rp, E), lambda b, h: (b, h, 0, 0)),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="tree_attention",
    )(layer_1, lengths_B, q_BxKxRxE, mask_BxRxU, lo_BxRx1, k_LxBxSxKxE, v_LxBxSxKxE)
  else:
    from jax.experimental.pallas import tpu as pltpu
    kv_dtype = k_LxBxSxKxE.dtype
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2, grid=(B, K),
        in_specs=[pl.BlockSpec((None, None, Rp, E), lambda b, h, *_: (b, h, 0, 0)),
                  pl.BlockSpec((None, Rp, Up), lambda b, h, *_: (b, 0, 0)),
                  pl.BlockSpec((None, Rp, 1), lambda b, h, *_: (b, 0, 0)),
                  pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=pl.BlockSpec((None, None, Rp, E), lambda b, h, *_: (b, h, 0, 0)),
        scratch_shapes=[pltpu.VMEM((bkv, E), kv_dtype), pltpu.VMEM((bkv, E), kv_dtype),
                        pltpu.VMEM((Up, E), kv_dtype), pltpu.VMEM((Up, E), kv_dtype)])
    o_BxKxRxE = pl.pallas_call(
        functools.partial(_tpu_kernel, **kw), out_shape=out_shape, grid_spec=grid_spec,
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=interpret, name="tree_attention",
    )(layer_1, lengths_B, q_BxKxRxE, mask_BxRxU, lo_BxRx1, k_LxBxSxKxE, v_LxBxSxKxE)

  o_BxKxTxGxE = o_BxKxRxE[:, :, :R].reshape(B, K, T, G, E)
  return o_BxKxTxGxE.transpose(0, 2, 1, 3, 4).reshape(B, T, H, E)

"""Triton kernels of RMSNorm and rotary embedding, one launch each, with the reference's float32 math.

rms_norm: one program per block of rows; each row is loaded once, whole (D <= MAX_NORM_DIM), and computed as
core/ops/norm.py does: x.float(), sum of squares / D, rsqrt(. + eps), (x * r) * w.float(), one rounding to
x's dtype. The differences from the reference are the order of the row sum (a tree here) and, on the GPU,
which approximate rsqrt runs, so float32 results agree to a few ulp, not bit for bit. add_rms_norm is the same
kernel (HAS_RESIDUAL) first forming x + residual as PyTorch does (float32 sum, one rounding to x's dtype),
storing it, and normalising that rounded sum.

apply_rope: one program per block of (token, head) rows of x viewed as [T, H, dim] with any token and head
strides (a q[..., nope:] slice needs no copy). Same math as core/ops/rope.py, in the same order: the cache
row [cos half | sin half] of each token's position, pairs (2i, 2i+1) or (i, i + dim/2), a*cos - b*sin and
b*cos + a*sin in float32 without FMA contraction, one rounding: bit-exact against the reference.

mla_rope_and_norm: MLA's c_kv norm, k_pe rope and q_pe rope in one launch (the same row helpers), one program
per block of tokens looping over their heads: a decode step's token is one program, a long prefill many.

The launchers assume the callers' validation (CudaFusedOps runs the reference's checks first) and never read
device values back. A position outside the cache on the GPU (which is not checked there) gives NaN rows
instead of an out-of-bounds read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer import quant
from deepinfer.ops import ExpertSum
from deepinfer.backends.cuda_sm100.pdl import enter, launch_kwargs

from deepinfer.backends.cuda_sm100.gemm import cdiv, interpreting, next_pow2
from deepinfer.backends.cuda_sm100.gemm_kernels import _cast, _quantize_rows
from deepinfer.backends.cuda_sm100.routing_kernels import expert_pairs, gatherable_rows, weighted_rows_sum

MAX_NORM_DIM = 16384  # a whole row stays in registers; wider rows go to the reference
_NORM_TILE = 4096  # elements per rms_norm program (rows are packed into a block up to this)
_ROPE_TILE = 2048  # pairs per rope program


@triton.jit
def _rms_norm_rows(x_ptr, r_ptr, w_ptr, o_ptr, s_ptr, rows, R, D, DF, stride_xr, stride_rr, stride_or, stride_sr, eps,
                   BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EXACT: tl.constexpr, STORE: tl.constexpr = True):
    """Rows `rows` (< R live) of x [R, D] (unit column stride) -> o in o's dtype. HAS_RESIDUAL: the rows of
    x + r [R, D], rounded to s's dtype and stored to s, are what gets normalised. Returns the normalised rows
    as rounded to o's dtype (float32 values) and their mask; STORE=False leaves o alone."""
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    x = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    res = _load_rows(r_ptr, rows, mask, stride_rr, BLOCK_D) if HAS_RESIDUAL else x
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    return _norm_rows(x, res, w, mask, o_ptr, s_ptr, rows, DF, stride_or, stride_sr, eps, BLOCK_D, HAS_RESIDUAL,
                      EXACT, STORE)


@triton.jit
def _load_rows(p, rows, mask, stride, BLOCK_D: tl.constexpr):
    cols = tl.arange(0, BLOCK_D)
    return tl.load(p + rows.to(tl.int64)[:, None] * stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _norm_rows(x, res, w, mask, o_ptr, s_ptr, rows, DF, stride_or, stride_sr, eps,
               BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EXACT: tl.constexpr, STORE: tl.constexpr):
    """_rms_norm_rows on rows already loaded: x and (HAS_RESIDUAL) res [BLOCK_R, BLOCK_D] float32, 0 where not
    `mask`, and the norm's weight w [BLOCK_D] float32."""
    cols = tl.arange(0, BLOCK_D)
    rows64 = rows.to(tl.int64)
    if HAS_RESIDUAL:
        # PyTorch's x + residual: a float32 sum, one rounding; the norm reads the rounded sum back
        s = _cast(x + res, s_ptr.dtype.element_ty, EXACT)
        tl.store(s_ptr + rows64[:, None] * stride_sr + cols[None, :], s, mask=mask)
        x = s.to(tl.float32)
    # The sum of squares in float64 (each square exact), rounded to float32 once at the end. The order of the
    # reduction follows the layout Triton picks for the whole kernel, which differs between the plain and the
    # quantising variant (sm_90 compile at D = 512: 4 vs 16 elements a thread), and their norms must agree bit
    # for bit. In float32 the two orders differed in the last bit now and then (an H200 test run caught it);
    # in float64 they differ by ~2^-43 relatively, which survives the rounding to float32 for ~1 row in 10^6.
    x64 = x.to(tl.float64)
    ms = (tl.sum(x64 * x64, axis=1) / DF).to(tl.float32)
    r = tl.math.rsqrt(ms + eps)
    y = _cast((x * r[:, None]) * w[None, :], o_ptr.dtype.element_ty, EXACT)  # normalise, then scale: the reference's order
    if STORE:
        tl.store(o_ptr + rows64[:, None] * stride_or + cols[None, :], y, mask=mask)
    return y.to(tl.float32), mask


@triton.jit
def _store_fp8_groups(q_ptr, qs_ptr, y, mask, rows, R, D, stride_qr, stride_qsr, stride_qsk,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows y [BLOCK_R, BLOCK_D] quantised per 128 columns as quant_fp8_kernel does: e4m3 into q [R, D], one fp32
    scale per group into qs (strided)."""
    NG: tl.constexpr = BLOCK_D // 128
    q, scale = _quantize_rows(tl.reshape(y, (BLOCK_R * NG, 128)), tl.reshape(mask, (BLOCK_R * NG, 128)))
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    tl.store(q_ptr + rows64[:, None] * stride_qr + cols[None, :], tl.reshape(q, (BLOCK_R, BLOCK_D)).to(tl.float8e4nv),
             mask=mask)
    g = tl.arange(0, NG)
    tl.store(qs_ptr + rows64[:, None] * stride_qsr + g[None, :] * stride_qsk, tl.reshape(scale, (BLOCK_R, NG)),
             mask=(rows[:, None] < R) & (g[None, :] * 128 < D))


@triton.jit(do_not_specialize=["R"])
def rms_norm_kernel(x_ptr, r_ptr, w_ptr, o_ptr, s_ptr, q_ptr, qs_ptr, R, D, DF, stride_xr, stride_rr, stride_or,
                    stride_sr, stride_qr, stride_qsr, stride_qsk, eps, pair_row_ptr, pair_w_ptr, add_ptr, stride_ar,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_RESIDUAL: tl.constexpr, EXACT: tl.constexpr,
                    QUANT: tl.constexpr = False, SUM_K: tl.constexpr = 0, SUM_ADD: tl.constexpr = False,
                    PDL: tl.constexpr = False):
    """x [R, D] (+ r [R, D] into s) -> o [R, D]; DF = float(D); one block of BLOCK_R rows per program. QUANT:
    the normalised rows (rounded to o's dtype, o itself not written) go to q / qs as FP8 activations.
    SUM_K > 0 (an ExpertSum as x, with a residual): x's rows are formed here, as combine_kernel forms them, from
    the expert rows at x_ptr, pair rows / weights [R, SUM_K] and, with SUM_ADD, add [R, D]; rounded to s's dtype."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    if SUM_K > 0:
        cols = tl.arange(0, BLOCK_D)
        mask = (rows[:, None] < R) & (cols[None, :] < D)
        # Before the wait on the previous launch (PDL), the sum's parts other than the expert rows: they were
        # written before the experts' GEMMs ran (ExpertSum), so their writers have finished.
        pair_rows, pair_weights = expert_pairs(pair_row_ptr, pair_w_ptr, rows, rows < R, SUM_K)
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        if SUM_ADD:
            x = _load_rows(add_ptr, rows, mask, stride_ar, BLOCK_D)
        else:
            x = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
        enter(PDL)
        res = _load_rows(r_ptr, rows, mask, stride_rr, BLOCK_D)  # issued with the expert rows' loads
        x = weighted_rows_sum(x_ptr, pair_rows, pair_weights, x, cols, mask, stride_xr, SUM_K)
        x = _cast(x, s_ptr.dtype.element_ty, EXACT).to(tl.float32)
        y, mask = _norm_rows(x, res, w, mask, o_ptr, s_ptr, rows, DF, stride_or, stride_sr, eps, BLOCK_D,
                             HAS_RESIDUAL, EXACT, not QUANT)
    else:
        enter(PDL)
        y, mask = _rms_norm_rows(x_ptr, r_ptr, w_ptr, o_ptr, s_ptr, rows, R, D, DF, stride_xr, stride_rr, stride_or,
                                 stride_sr, eps, BLOCK_D, HAS_RESIDUAL, EXACT, not QUANT)
    if QUANT:
        _store_fp8_groups(q_ptr, qs_ptr, y, mask, rows, R, D, stride_qr, stride_qsr, stride_qsk, BLOCK_R, BLOCK_D)


@triton.jit
def _rope_angles(pos_ptr, cache_ptr, tok, live, P, stride_p, stride_c, HALF: tl.constexpr, HALF_P: tl.constexpr):
    """cos and sin [n, HALF_P] float32 of tokens tok's positions (NaN where a position is outside the cache)."""
    pos = tl.load(pos_ptr + tok * stride_p, mask=live, other=0).to(tl.int64)
    i = tl.arange(0, HALF_P)
    cs_mask = (live & (pos >= 0) & (pos < P))[:, None] & (i < HALF)[None, :]
    cs = cache_ptr + pos[:, None] * stride_c + i[None, :]
    cos = tl.load(cs, mask=cs_mask, other=float("nan")).to(tl.float32)
    sin = tl.load(cs + HALF, mask=cs_mask, other=float("nan")).to(tl.float32)
    return cos, sin


@triton.jit
def _rope_apply(x_ptr, tok, head, live, cos, sin, stride_xt, stride_xh, HALF: tl.constexpr, HALF_P: tl.constexpr,
                INTERLEAVED: tl.constexpr):
    """Rows (tok, head) of x roped by their cos / sin: the pairs' columns ia, ib [HALF_P], the valid mask and the
    rotated halves in float32, unrounded (a*cos - b*sin, b*cos + a*sin: without FMA contraction, the launch's
    enable_fp_fusion=False, they are the reference's values)."""
    i = tl.arange(0, HALF_P)
    if INTERLEAVED:
        ia, ib = 2 * i, 2 * i + 1
    else:
        ia, ib = i, i + HALF
    mask = live[:, None] & (i < HALF)[None, :]
    xrow = x_ptr + (tok * stride_xt + head * stride_xh)[:, None]
    a = tl.load(xrow + ia[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(xrow + ib[None, :], mask=mask, other=0.0).to(tl.float32)
    return ia, ib, mask, a * cos - b * sin, b * cos + a * sin


@triton.jit
def _rope_rows(x_ptr, pos_ptr, cache_ptr, o_ptr, rows, live, H, P, stride_xt, stride_xh, stride_p, stride_c,
               HALF: tl.constexpr, HALF_P: tl.constexpr, INTERLEAVED: tl.constexpr, EXACT: tl.constexpr):
    """Rows r = t * H + h (where `live`) of x [T, H, 2*HALF] (strided, unit last stride) -> o [T*H, 2*HALF]."""
    tok = (rows // H).to(tl.int64)
    cos, sin = _rope_angles(pos_ptr, cache_ptr, tok, live, P, stride_p, stride_c, HALF, HALF_P)
    ia, ib, mask, out_a, out_b = _rope_apply(x_ptr, tok, (rows % H).to(tl.int64), live, cos, sin, stride_xt, stride_xh,
                                             HALF, HALF_P, INTERLEAVED)
    orow = o_ptr + (rows.to(tl.int64) * (2 * HALF))[:, None]
    tl.store(orow + ia[None, :], _cast(out_a, o_ptr.dtype.element_ty, EXACT), mask=mask)
    tl.store(orow + ib[None, :], _cast(out_b, o_ptr.dtype.element_ty, EXACT), mask=mask)


@triton.jit(do_not_specialize=["R"])
def rope_kernel(x_ptr, pos_ptr, cache_ptr, o_ptr, R, H, P, stride_xt, stride_xh, stride_p, stride_c,
                HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr, INTERLEAVED: tl.constexpr,
                EXACT: tl.constexpr, PDL: tl.constexpr = False):
    """x [T, H, 2*HALF] (strided, unit last stride), rows r = t * H + h -> o [T*H, 2*HALF] contiguous."""
    enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    _rope_rows(x_ptr, pos_ptr, cache_ptr, o_ptr, rows, rows < R, H, P, stride_xt, stride_xh, stride_p, stride_c,
               HALF, HALF_P, INTERLEAVED, EXACT)


@triton.jit(do_not_specialize=["T"])
def mla_rope_norm_kernel(q_ptr, kv_ptr, kpe_ptr, w_ptr, pos_ptr, cache_ptr, qo_ptr, ckv_ptr, ko_ptr,
                         T, R, RF, P, stride_qt, stride_qh, stride_kv, stride_p, stride_c, eps,
                         H: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, INTERLEAVED: tl.constexpr, EXACT: tl.constexpr,
                         PDL: tl.constexpr = False):
    """BLOCK_T tokens per program: c_kv [T, R] = RMSNorm(kv[:, :R]), ko [T, 2*HALF] = rope(kpe = kv[:, R:]),
    then the block's q rows t * H + h, BLOCK_Q at a time, into qo [T*H, 2*HALF]; RF = float(R). H is a model
    constant: a constant divisor for the rows' token index, and a loop bound the interpreter can evaluate."""
    enter(PDL)
    _mla_rope_norm_block(tl.program_id(0) * BLOCK_T, q_ptr, kv_ptr, kpe_ptr, w_ptr, pos_ptr, cache_ptr, qo_ptr, ckv_ptr,
                         ko_ptr, T, R, RF, P, stride_qt, stride_qh, stride_kv, stride_p, stride_c, eps, H, HALF, HALF_P,
                         BLOCK_T, BLOCK_D, BLOCK_Q, INTERLEAVED, EXACT)


@triton.jit
def _mla_rope_norm_block(t0, q_ptr, kv_ptr, kpe_ptr, w_ptr, pos_ptr, cache_ptr, qo_ptr, ckv_ptr, ko_ptr,
                         T, R, RF, P, stride_qt, stride_qh, stride_kv, stride_p, stride_c, eps,
                         H: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_T: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_Q: tl.constexpr, INTERLEAVED: tl.constexpr, EXACT: tl.constexpr):
    """mla_rope_norm_kernel's work for the tokens [t0, t0 + BLOCK_T); c_kv rows have R columns (contiguous)."""
    toks = t0 + tl.arange(0, BLOCK_T)
    _rms_norm_rows(kv_ptr, kv_ptr, w_ptr, ckv_ptr, ckv_ptr, toks, T, R, RF, stride_kv, 0, R, 0, eps,
                   BLOCK_D, False, EXACT)
    _rope_rows(kpe_ptr, pos_ptr, cache_ptr, ko_ptr, toks, toks < T, 1, P, stride_kv, 0, stride_p, stride_c,
               HALF, HALF_P, INTERLEAVED, EXACT)
    _rope_block_queries(t0, q_ptr, pos_ptr, cache_ptr, qo_ptr, T, P, stride_qt, stride_qh, stride_p, stride_c, H, HALF,
                        HALF_P, BLOCK_T, BLOCK_Q, INTERLEAVED, EXACT)


@triton.jit
def _rope_block_queries(t0, q_ptr, pos_ptr, cache_ptr, qo_ptr, T, P, stride_qt, stride_qh, stride_p, stride_c,
                        H: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_T: tl.constexpr,
                        BLOCK_Q: tl.constexpr, INTERLEAVED: tl.constexpr, EXACT: tl.constexpr):
    """The q rows t * H + h of tokens [t0, t0 + BLOCK_T) roped into qo, BLOCK_Q at a time (the same trip count in
    every program: the last block masks its missing tokens)."""
    for r0 in range(0, BLOCK_T * H, BLOCK_Q):
        rel = r0 + tl.arange(0, BLOCK_Q)
        rows = t0 * H + rel
        _rope_rows(q_ptr, pos_ptr, cache_ptr, qo_ptr, rows, (rel < BLOCK_T * H) & (rows < T * H), H, P, stride_qt,
                   stride_qh, stride_p, stride_c, HALF, HALF_P, INTERLEAVED, EXACT)


def _rows_view(x: torch.Tensor, lead: int) -> torch.Tensor:
    """x viewed as [x.shape[:lead]..., -1, x.shape[-1]] with a unit last stride, copying only if it cannot be."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    shape = (*x.shape[:lead], -1, x.shape[-1])
    try:
        return x.view(shape)
    except RuntimeError:  # the middle dimensions do not collapse into one stride
        return x.contiguous().view(shape)


def _warps(elems: int) -> int:
    return 4 if elems <= 2048 else 8 if elems <= 8192 else 16


def _rms_norm(x: torch.Tensor | ExpertSum, weight: torch.Tensor, eps: float, residual: torch.Tensor | None,
              quantize: bool = False):
    d = x.shape[-1]
    dtype = x.dtype
    summed = None if residual is None else torch.empty(x.shape, dtype=dtype, device=x.device)
    if quantize:  # x [T, D]: e4m3 rows and column-major scales ([KB, T] transposed), as quantize_fp8 makes them
        q = torch.empty(x.shape, dtype=quant.FP8_DTYPE, device=x.device)
        qs = torch.empty(cdiv(d, quant.FP8_BLOCK), x.shape[0], dtype=torch.float32, device=x.device).t()
        out = quant.Fp8Activations(q, qs, dtype)
    else:
        out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.shape.numel() == 0:
        return out, summed
    expert_sum = x if isinstance(x, ExpertSum) else None
    if expert_sum is not None:  # the expert rows stand in for x; the sum's other parts go to their own arguments
        x2 = gatherable_rows(_rows_view(expert_sum.rows, 0))
        pair_rows, pair_w = expert_sum.row_of_pair.contiguous(), expert_sum.weights.contiguous()
        add = None if expert_sum.add is None else _rows_view(expert_sum.add, 0)
    else:
        x2 = _rows_view(x, 0)
        pair_rows = pair_w = add = None
    # Without a residual the kernel never touches r / s, nor o when quantising (only o's dtype is read): x, or
    # the sum's own tensor, stands in for them.
    o2 = out.view(-1, d) if not quantize else x2 if expert_sum is None else summed.view(-1, d)
    r2, s2 = (x2, o2) if residual is None else (_rows_view(residual, 0), summed.view(-1, d))
    q2, qs2 = (q, qs) if quantize else (o2, o2)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    r = s2.shape[0] if expert_sum is not None else x2.shape[0]
    bd = max(next_pow2(d), quant.FP8_BLOCK if quantize else 1)  # quantising takes whole 128-column groups
    br = max(1, min(next_pow2(r), _NORM_TILE // bd))
    warps, options = _warps(br * bd), {}
    if expert_sum is not None:
        # Every choice's row in flight at once: 8 columns a thread (one 16-byte load of a bf16 row each), and a
        # register cap, without which ptxas (sm_90 compile, 8 warps) issued the rows' loads ~3 at a time.
        warps, options = min(16, max(4, br * bd // 256)), {"maxnreg": 128}
    rms_norm_kernel[(cdiv(r, br),)](x2, r2, w, o2, s2, q2, qs2, r, d, float(d), x2.stride(0), r2.stride(0),
                                    o2.stride(0), s2.stride(0), q2.stride(0), qs2.stride(0), qs2.stride(1) if quantize else 0,
                                    float(eps), x2 if pair_rows is None else pair_rows, x2 if pair_w is None else pair_w,
                                    x2 if add is None else add, 0 if add is None else add.stride(0),
                                    BLOCK_R=br, BLOCK_D=bd, HAS_RESIDUAL=residual is not None, EXACT=interpreting(),
                                    QUANT=quantize, SUM_K=0 if expert_sum is None else pair_rows.shape[1],
                                    SUM_ADD=add is not None, num_warps=warps, enable_fp_fusion=False,
                                    **options, **launch_kwargs())
    return out, summed


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Validated x [..., D] (D <= MAX_NORM_DIM), weight [D] -> RMSNorm in x's dtype, one launch."""
    return _rms_norm(x, weight, eps, None)[0]


def add_rms_norm(x: torch.Tensor | ExpertSum, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 quantize: bool = False) -> tuple[torch.Tensor | quant.Fp8Activations, torch.Tensor]:
    """Validated x, residual [..., D] of one dtype -> (RMSNorm(x + residual), x + residual), one launch; quantize
    (x [T, D]): the norm as Fp8Activations (quant_fp8_kernel's values of the rounded norm). x may be a validated
    ExpertSum ([T, D], residual [T, D]): its sum is formed in the same launch, rounded to its dtype."""
    return _rms_norm(x, weight, eps, residual, quantize)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Validated x [T, ..., dim] (even dim, ndim >= 2), positions [T], cache [P, dim] -> rotated copy of x."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    t, dim = x.shape[0], x.shape[-1]
    x3 = _rows_view(x, 1)
    heads = x3.shape[1]
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = dim // 2
    half_p = next_pow2(half)
    rows = t * heads
    br = max(1, min(next_pow2(rows), _ROPE_TILE // half_p))
    # enable_fp_fusion=False: a*cos - b*sin must not become an FMA, so results match the reference's
    # separately rounded products bit for bit
    rope_kernel[(cdiv(rows, br),)](x3, positions, cache, out, rows, heads, cache.shape[0],
                                   x3.stride(0), x3.stride(1), positions.stride(0), cache.stride(0),
                                   HALF=half, HALF_P=half_p, BLOCK_R=br, INTERLEAVED=bool(interleaved),
                                   EXACT=interpreting(), num_warps=4, enable_fp_fusion=False,
                                   **launch_kwargs())
    return out


def mla_rope_and_norm(q_pe: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                      cos_sin_cache: torch.Tensor, interleaved: bool
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Validated q_pe [T, H, rope], kv [T, R + rope], weight [R] (R <= MAX_NORM_DIM, even rope) ->
    (q_pe roped, RMSNorm(kv[:, :R]), kv[:, R:] roped), contiguous, in one launch."""
    q_out, c_kv, k_out, launch = mla_rope_norm_launch(q_pe, kv, weight, eps, positions, cos_sin_cache, interleaved)
    if launch is not None:
        grid, kwargs = launch
        mla_rope_norm_kernel[grid](**kwargs)
    return q_out, c_kv, k_out


def mla_rope_norm_launch(q_pe: torch.Tensor, kv: torch.Tensor, weight: torch.Tensor, eps: float, positions: torch.Tensor,
                         cos_sin_cache: torch.Tensor, interleaved: bool):
    """mla_rope_and_norm's outputs (allocated) and its launch (grid, keyword arguments), None for no tokens:
    shared with the fused cache write (attention.rope_norm_and_write), whose kernel runs the same block first."""
    t, heads, rope = q_pe.shape
    r = weight.shape[0]
    q_out = torch.empty(q_pe.shape, dtype=q_pe.dtype, device=q_pe.device)
    c_kv = torch.empty((t, r), dtype=kv.dtype, device=kv.device)
    k_out = torch.empty((t, rope), dtype=kv.dtype, device=kv.device)
    if t == 0:
        return q_out, c_kv, k_out, None
    q3 = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    kv2 = kv if kv.stride(-1) == 1 else kv.contiguous()
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = rope // 2
    half_p = next_pow2(half)
    bd = next_pow2(r)
    # Token blocks sized like rms_norm's (8 tokens for R = 512: 2048 programs at a 16k-token prefill); each
    # program walks its tokens' heads in rope-sized tiles, so one decode token is a single program.
    bt = max(1, min(next_pow2(t), _NORM_TILE // bd))
    bq = max(1, min(next_pow2(bt * heads), _ROPE_TILE // half_p))
    kwargs = dict(
        q_ptr=q3, kv_ptr=kv2, kpe_ptr=kv2[:, r:], w_ptr=w, pos_ptr=positions, cache_ptr=cache, qo_ptr=q_out,
        ckv_ptr=c_kv, ko_ptr=k_out, T=t, R=r, RF=float(r), P=cache.shape[0], stride_qt=q3.stride(0),
        stride_qh=q3.stride(1), stride_kv=kv2.stride(0), stride_p=positions.stride(0), stride_c=cache.stride(0),
        eps=float(eps), H=heads, HALF=half, HALF_P=half_p, BLOCK_T=bt, BLOCK_D=bd, BLOCK_Q=bq,
        INTERLEAVED=bool(interleaved), EXACT=interpreting(), num_warps=_warps(max(bt * bd, bq * half_p)),
        enable_fp_fusion=False, **launch_kwargs())  # no FMA: rope bit-exact, as rope_kernel
    return q_out, c_kv, k_out, ((cdiv(t, bt),), kwargs)

"""The decoding plans: a decoding step as a short sequence of native calls.

:class:`FusedDecoder` (path ``"fused"``) runs each cached step of a standard GPT (see
:func:`tinylm.native.plan.eligibility`) with no module dispatch: per block LayerNorm,
QKV, attention over the cache (writing the new key and value), the output projection
with the residual add fused in, LayerNorm, the FFN up-projection with GELU fused in, and
the down-projection with its residual add. It computes exactly the math of
``GPT.forward`` (tests/test_equivalence.py holds it to repeated full forwards). Weights
are read once per step from packed copies (kept across calls while the weights are
unchanged); the model itself is never modified. A :class:`tinylm.layers.quantized.QuantizedLinear`
is read as int8 integers and float32 scales, packed once into panels (``Library.pack_q8``;
the model keeps them as stored). A :class:`tinylm.layers.blocks.BlockLinear`'s GGUF blocks
(Q4_0, Q4_1, Q8_0) are moved once into panels of 16 rows (``Library.pack_blocks``: the
same codes and fp16 scales) and read by ``csrc/blocks.c``, which quantizes the
activations per block of 32 as llama.cpp does.

:class:`VariantDecoder` (path ``"fused-variant"``) is the same for the architecture
variants of ``ModelConfig`` (:func:`tinylm.native.plan.eligibility` decides which):
the same native linear and cached-attention calls, RMSNorm natively, QK-norm and RoPE
as one native pass over q's and one over k's heads in place (``tl_rope_heads``; the
reference modules and :func:`tinylm.core.attention.apply_rope` for a norm that is not the
reference RMSNorm), the SwiGLU/ReLU² MLPs by torch's ops on the step's (B, ·) rows, and
grouped-query attention as one attention call per row in which each group of H / H_kv
query heads reads its one cached key/value head.

:class:`NativeCacheDecoder` (path ``"cache"``) is for a model the fused step does not
know (e.g. one with tinylm.layers.lowrank's layers): the model's own forward, with a
:class:`NativeKVCache` whose one-token attention is one native pass.

The prompt pass runs the model's own forward (large products, where BLAS is right),
except that the fused plans put a short prompt of a model with int8 or block layers
through their step, position by position (the forward would dequantize every weight
first). Both plans take the greedy argmax natively.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm.core.attention import RMSNorm, apply_rope, rope_angles
from tinylm.core.decoding import Decoder, KVCache, RaggedDecoder, RaggedKVCache
from tinylm.core.model import FeedForward, GatedFeedForward
from tinylm.layers.blocks import BlockLinear
from tinylm.layers.registry import decoding_of
from tinylm.native.ops import Library, PackedBlocks, PackedQ8, check, header_constant
from tinylm.native.variants import signed_sin

if TYPE_CHECKING:
    from tinylm.layers.quantized import QuantizedLinear


class NativeKVCache(KVCache):
    """A KVCache whose one-token steps run :meth:`Library.attend_one`: the new key/value
    written and every cached one read in one pass, no SDPA dispatch."""

    def __init__(self, *args, lib: Library, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _, B, H, max_len, _ = self.k.shape
        self.lib = lib
        self.scratch = torch.empty(B * H * max_len)  # attention scores, (B·H, T)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.check_room(1)
        if q.dtype != torch.float32 or q.stride(-1) != 1 or self.k.dtype != torch.float32 \
                or k.shape[1] != q.shape[1]:  # grouped-query attention: SDPA (enable_gqa)
            return super().attend(layer, q, k, v)
        return self.lib.attend_one(q, k, v, self.k[layer], self.v[layer], self.length,
                                   self.scratch)


# Packed copies by weight, so repeated generate() calls on one model pack once. The
# entry is dropped when the weight is freed, and rebuilt when the weight was changed
# in place (its version counter moved) or replaced.
_packed: dict[int, tuple[weakref.ref, int, int, Tensor]] = {}
_packed_q8: dict[int, tuple[weakref.ref, tuple, PackedQ8]] = {}
_packed_blocks: dict[int, tuple[weakref.ref, tuple, PackedBlocks]] = {}


def packed_weight(lib: Library, weight: Tensor) -> Tensor:
    """The panel-packed copy of a (O, I) float32 CPU weight, cached while it is unchanged."""
    key = id(weight)
    entry = _packed.get(key)
    if entry is not None:
        ref, version, ptr, packed = entry
        if ref() is weight and version == weight._version and ptr == weight.data_ptr():
            return packed
    packed = lib.pack(weight)
    _packed[key] = (weakref.ref(weight, lambda _r, k=key: _packed.pop(k, None)),
                    weight._version, weight.data_ptr(), packed)
    return packed


def packed_q8(lib: Library, lin: QuantizedLinear) -> PackedQ8:
    """The panel-packed copy of a QuantizedLinear's integers and scales (csrc/quant.c),
    cached while both are unchanged (keyed by the integers, as :func:`packed_weight`)."""
    q, s = lin.qweight, lin.scale
    key = id(q)
    entry = _packed_q8.get(key)
    stamp = (q._version, q.data_ptr(), id(s), s._version, s.data_ptr(), lin.group_size)
    if entry is not None:
        ref, version, packed = entry
        if ref() is q and version == stamp:
            return packed
    G = lin.in_features if lin.group_size is None else min(lin.group_size, lin.in_features)
    packed = lib.pack_q8(q.detach().contiguous(), s.detach().contiguous(), G)
    _packed_q8[key] = (weakref.ref(q, lambda _r, k=key: _packed_q8.pop(k, None)), stamp, packed)
    return packed


def packed_blocks(lib: Library, lin: BlockLinear) -> PackedBlocks:
    """The panel copy of a BlockLinear's GGUF blocks (csrc/blocks.c), cached while they
    are unchanged (keyed by the blocks, as :func:`packed_weight`)."""
    w = lin.blocks
    key = id(w)
    entry = _packed_blocks.get(key)
    stamp = (w._version, w.data_ptr(), lin.block_type, lin.in_features)
    if entry is not None:
        ref, version, packed = entry
        if ref() is w and version == stamp:
            return packed
    packed = lib.pack_blocks(w.detach(), lin.block_type, lin.in_features)
    _packed_blocks[key] = (weakref.ref(w, lambda _r, k=key: _packed_blocks.pop(k, None)), stamp,
                           packed)
    return packed


class _NativeArgmax(Decoder):
    lib: Library

    def argmax(self, logits: Tensor) -> Tensor:
        if logits.dtype == torch.float32 and logits.device.type == "cpu" \
                and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[1] > 0:
            return self.lib.argmax(logits)
        return logits.argmax(-1)


class NativeCacheDecoder(_NativeArgmax):
    """The model's own forward through a :class:`NativeKVCache` (float32 CPU models)."""

    path = "cache"

    def __init__(self, model: nn.Module, batch_size: int, lib: Library) -> None:
        self.lib = lib
        super().__init__(model, batch_size, NativeKVCache.for_model(model, batch_size, lib=lib))


# A prompt of at most this many tokens (all rows together) of a model with int8 layers is
# prefilled by the fused step, position by position (FusedDecoder.prefill).
INT8_PREFILL_ROWS = 128


class FusedDecoder(_NativeArgmax):
    """Prefill through the model's forward, then each step as :class:`_FusedStep`."""

    path = "fused"

    def __init__(self, model: nn.Module, batch_size: int, lib: Library) -> None:
        self.lib = lib
        super().__init__(model, batch_size, NativeKVCache.for_model(model, batch_size, lib=lib))
        self._fused = self._step_class()(model, self.cache, lib)
        self._int8 = any(decoding_of(m) in ("int8", "blocks") for m in model.modules())

    @staticmethod
    def _step_class() -> type:
        return _FusedStep

    def extend(self, ids: Tensor) -> Tensor:
        """The model's forward over the prompt (large products: BLAS), except for a model
        with int8 layers and a short prompt: its forward would dequantize every weight, so
        the prompt goes through the fused step one position at a time instead (the int8
        kernel; the LM head at the last position only). A longer prompt of a model with
        GGUF block layers runs the forward with those layers' products on the blocks
        kernel (:func:`_blocks_by_kernel`), not on their dequantized weights. ``prefill``
        is reset + this."""
        B, T = ids.shape if ids.dim() == 2 else (0, 0)
        if not self._int8 or B != self._fused.B or not 0 < T * B <= INT8_PREFILL_ROWS \
                or self.cache.length + T > self.cache.max_len:
            with _blocks_by_kernel(self.model, self.lib):
                return super().extend(ids)
        for t in range(T - 1):
            self._fused(ids[:, t], head=False)
        return self._fused(ids[:, T - 1])

    def step(self, ids: Tensor) -> Tensor:
        self.cache.check_room(1)
        return self._fused(ids)


class _KernelBlockLinear(BlockLinear):
    """:class:`BlockLinear` whose forward is the blocks kernel (csrc/blocks.c: activations
    quantized per block of 32, integer dot products; ``kernel_product``'s arithmetic) on
    its packed blocks, for float32 CPU inputs: the prompt pass of a decoding plan."""

    reference_class = BlockLinear
    _tinylm_lib: Library

    def forward(self, x: Tensor) -> Tensor:
        if x.dtype != torch.float32 or x.device.type != "cpu" or x.shape[-1] == 0:
            return super().forward(x)
        rows = x.reshape(-1, self.in_features).contiguous()
        y = self._tinylm_lib.linear_blocks_packed(rows, packed_blocks(self._tinylm_lib, self),
                                                  self.bias)
        return y.reshape(*x.shape[:-1], self.out_features)


@contextmanager
def _blocks_by_kernel(model: nn.Module, lib: Library) -> Iterator[None]:
    """Within the block, every :class:`BlockLinear` of ``model`` computes by the blocks
    kernel (a class swap, undone on exit, as :class:`tinylm.native.plan.Plan` swaps):
    a 512-token prompt's products then read the 4-bit codes (~5x faster than
    dequantizing every weight for ``F.linear`` on one core)."""
    swapped = [m for m in model.modules() if type(m) is BlockLinear]
    for m in swapped:
        m.__class__ = _KernelBlockLinear
        m._tinylm_lib = lib
    try:
        yield
    finally:
        for m in swapped:
            m.__class__ = BlockLinear
            m.__dict__.pop("_tinylm_lib", None)


class _FusedStep:
    """``GPT.forward`` for one token per row through the cache, as native kernel calls.

    Every buffer is allocated once and checked there (float32, CPU, contiguous, sized
    from the config); a step allocates only its logits and passes the pointers of its
    own buffers to the unchecked calls. The blocks run as one call, ``tl_decode_layers``
    (csrc/decode.c, whose loop names the equation each kernel computes: LN1, QKV,
    attention over the cache, output projection + residual, LN2, up + GELU, down +
    residual), over a plan of every layer's pointers and sizes built here once: a step
    makes a handful of calls from Python, not forty."""

    def __init__(self, model: nn.Module, cache: NativeKVCache, lib: Library) -> None:
        cfg = model.config
        self.lib, self.checked = lib.raw, lib
        self.cache = cache
        B = cache.k.shape[1]
        self.B, self.E, self.H, self.D = B, cfg.n_embd, cfg.n_head, cfg.head_dim
        self.V, self.eps = cfg.vocab_size, cfg.norm_eps
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.threads = torch.get_num_threads()
        HD = cfg.n_head * cfg.head_dim
        self.x = torch.empty(B, cfg.n_embd)  # the residual stream
        self.h = torch.empty(B, cfg.n_embd)  # LayerNorm outputs
        self.qkv = torch.empty(B, 3 * HD)
        self.r = torch.empty(B, HD)  # attention output, heads side by side
        self.u = torch.empty(B, cfg.ffn_dim)  # GELU(up(h))
        self.ids = torch.empty(B, dtype=torch.int64)
        self.capacity, self.positions = B, torch.empty(B, dtype=torch.int64)  # see _rows
        self.scratch = torch.empty(B * cfg.n_head * cache.max_len)  # attention scores
        self.stats = torch.empty(2, B)  # LayerNorm's per-row mean and 1/std (unused)
        self.keep = []  # packed weights and contiguous biases the pointers refer to
        self.tok, self.pos = self._ptr(model.tok_emb.weight), self._ptr(model.pos_emb.weight)
        self.blocks = [
            (self._norm(b.ln1), self._linear(b.attn.qkv), self._linear(b.attn.out),
             self._norm(b.ln2), self._linear(b.ffn.up), self._linear(b.ffn.down))
            for b in model.blocks]
        self.final_norm = self._norm(model.final_norm)
        self.head = self._linear(model.lm_head)
        self.plan = self._plan()
        for name, t in (("cache.k", cache.k), ("cache.v", cache.v)):  # (L, B, H, T, D)
            check(name, t, (len(self.blocks), B, self.H, cache.max_len, self.D))

    def _rows(self) -> int:
        """The rows this step feeds, also set as ``B`` (every kernel reads the first B rows
        of the buffers), and their positions in ``positions``: every row of a KVCache at
        its one length, or the rows in use of a RaggedKVCache (continuous batching) each
        at its own. The step's threads are the calling thread's torch threads."""
        cache = self.cache
        if isinstance(cache, RaggedKVCache):
            self.B = cache.rows
            self.positions[:self.B].copy_(cache.lengths[:self.B])
        else:
            self.B = self.capacity
            self.positions.fill_(cache.length)
        self.threads = torch.get_num_threads()
        return self.B

    def _plan(self) -> Tensor:
        """The blocks' pointers and sizes as tl_decode_layers reads them (csrc/tinylm.h:
        PLAN_LAYER longs per layer; a linear is PLAN_LINEAR of them; NULL is 0)."""
        rows = []
        for ln1, w_qkv, w_out, ln2, w_up, w_down in self.blocks:
            row = [*ln1]
            for lin in (w_qkv, w_out):
                row += self._plan_linear(lin)
            row += [*ln2]
            for lin in (w_up, w_down):
                row += self._plan_linear(lin)
            rows.append([v or 0 for v in row])
        plan = torch.tensor(rows, dtype=torch.int64)
        check("plan", plan, (len(self.blocks), header_constant("PLAN_LAYER")),
              dtype=torch.int64)
        return plan

    @staticmethod
    def _plan_linear(lin: tuple) -> list[int | None]:
        """PLAN_LINEAR entries: packed weights (or GGUF blocks), int8 scales and group (0,
        0: not int8), bias, I, O, GGUF block type (0: none) (a wrong count fails the plan's
        shape check above)."""
        weights, bias, I, O = lin
        how, ptr, *rest = weights
        int8 = rest if how == "int8" else (0, 0)
        return [ptr, *int8, bias, I, O, rest[0] if how == "blocks" else 0]

    def _ptr(self, t: Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().contiguous()
        check("weight", t)  # float32, CPU: the raw calls below rely on it
        self.keep.append(t)
        return t.data_ptr()

    def _norm(self, ln: nn.LayerNorm) -> tuple[int | None, int | None]:
        return self._ptr(ln.weight), self._ptr(ln.bias)

    def _linear(self, lin: nn.Module) -> tuple:
        """((how, weight pointers...), bias, I, O): ("f32", a packed fp32 weight), for a
        QuantizedLinear ("int8", its packed integers, scales, group size: csrc/quant.c),
        for a BlockLinear ("blocks", its GGUF blocks in panels of 16 rows, the GGML type
        id: csrc/blocks.c)."""
        how = decoding_of(lin)
        if how == "int8":
            check("qweight", lin.qweight, (lin.out_features, lin.in_features),
                  dtype=torch.int8, contiguous=False)
            p = packed_q8(self.checked, lin)
            self.keep.append(p)
            weights = ("int8", p.qweight.data_ptr(), p.scale.data_ptr(), p.group_size)
        elif how == "blocks":
            p = packed_blocks(self.checked, lin)
            self.keep.append(p)
            weights = ("blocks", p.data.data_ptr(), p.type_id)
        else:
            packed = packed_weight(self.checked, lin.weight)
            self.keep.append(packed)
            weights = ("f32", packed.data_ptr())
        return weights, self._ptr(lin.bias), lin.in_features, lin.out_features

    def _mm(self, x: Tensor, lin: tuple, y: Tensor, act: int = 0,
            res: Tensor | None = None) -> None:
        (how, *weights), bias, I, O = lin
        r = res.data_ptr() if res is not None else None
        if how == "int8":  # y = act(x·(q·s)ᵀ + b) (+ res)
            self.lib.tl_linear_q8(x.data_ptr(), I, *weights, bias, y.data_ptr(), self.B, I, O,
                                  self.threads, act, r)
        elif how == "blocks":  # GGUF blocks, x quantized per block of 32
            self.lib.tl_linear_blocks(x.data_ptr(), I, *weights, bias, y.data_ptr(), self.B,
                                      I, O, self.threads, act, r)
        else:
            self.lib.tl_linear(x.data_ptr(), I, weights[0], bias, y.data_ptr(), self.B, I, O,
                               self.threads, act, r)

    def _ln(self, x: Tensor, norm: tuple, y: Tensor) -> None:
        mean, rstd = self.stats  # a few rows: one thread, no parallel region to start
        self.lib.tl_ln_fwd(x.data_ptr(), norm[0], norm[1], y.data_ptr(), mean.data_ptr(),
                           rstd.data_ptr(), self.B, self.E, self.eps, 1)

    def __call__(self, ids: Tensor, head: bool = True) -> Tensor | None:
        """One token per row -> logits (B, V); without ``head``, only the cache advances.
        The caller checked that every row's position is < max_len (check_room)."""
        cache, lib = self.cache, self.lib
        B, H, D = self._rows(), self.H, self.D
        self.ids[:B].copy_(ids)
        x, h, qkv, r, u = self.x, self.h, self.qkv, self.r, self.u
        if lib.tl_embed_rows(self.ids.data_ptr(), self.tok, self.pos,
                             self.positions.data_ptr(), x.data_ptr(), B, self.E, self.V):
            raise ValueError(f"token ids must be in [0, {self.V}), got {ids.tolist()}")
        k, v = cache.k, cache.v  # (L, B, H, max_len, D)
        lib.tl_decode_layers(self.plan.data_ptr(), len(self.blocks), x.data_ptr(),
                             h.data_ptr(), qkv.data_ptr(), r.data_ptr(), u.data_ptr(),
                             self.stats.data_ptr(), k.data_ptr(), v.data_ptr(), k.stride(0),
                             k.stride(1), k.stride(2), B, self.E, H, D,
                             self.positions.data_ptr(), self.eps, self.scale,
                             self.scratch.data_ptr(), cache.max_len, self.threads)
        cache.advance(1)
        if not head:
            return None
        self._ln(x, self.final_norm, h)
        logits = torch.empty(B, self.V)
        self._mm(h, self.head, logits)  # logits = h·W_headᵀ (tied: the token embedding)
        return logits


class FusedRaggedDecoder(RaggedDecoder):
    """The continuous-batching step on the fused native kernels: one call of
    :class:`_FusedStep` (``variant``: :class:`_VariantStep`) for the rows in use of a
    :class:`~tinylm.core.decoding.RaggedKVCache`, each row at its own position (its
    embedding, rotation and attention), rows joining and leaving between steps. The
    cache stays the reference's, so a forward of C > 1 tokens per row (a speculative
    draft to verify) runs the model's own forward on it."""

    def __init__(self, model: nn.Module, batch_size: int, lib: Library, variant: bool) -> None:
        super().__init__(model, batch_size)
        self.path = "fused-variant" if variant else "fused"
        self._fused = (_VariantStep if variant else _FusedStep)(model, self.cache, lib)

    def step(self, ids: Tensor) -> Tensor:
        self.cache.check_room(1)
        return self._fused(ids)


class VariantDecoder(FusedDecoder):
    """:class:`FusedDecoder` for the architecture variants: each step is a
    :class:`_VariantStep`."""

    path = "fused-variant"

    @staticmethod
    def _step_class() -> type:
        return _VariantStep


class _VariantStep(_FusedStep):
    """:class:`_FusedStep` for any layout of ``ModelConfig``: norms (LayerNorm and
    RMSNorm natively), learned or rotary positions, QK-norm (with the rotation, one
    native pass per q and k), GELU/ReLU² or SwiGLU, and H_kv <= H key/value heads in the
    cache."""

    def __init__(self, model: nn.Module, cache: NativeKVCache, lib: Library) -> None:
        cfg = model.config
        self.lib, self.checked, self.cache, self.keep = lib.raw, lib, cache, []
        B = self.B = cache.k.shape[1]
        self.E, self.H, self.Hkv, self.D = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.V, self.scale = cfg.vocab_size, 1.0 / math.sqrt(cfg.head_dim)
        self.threads = torch.get_num_threads()
        self.x, self.h = torch.empty(B, cfg.n_embd), torch.empty(B, cfg.n_embd)
        self.qkv = torch.empty(B, cfg.inner_dim + 2 * cfg.kv_dim)  # [q | k | v]
        self.r = torch.empty(B, cfg.inner_dim)
        self.g, self.u = torch.empty(B, cfg.ffn_dim), torch.empty(B, cfg.ffn_dim)
        self.stats = torch.empty(2, B)
        self.capacity, self.positions = B, torch.empty(B, dtype=torch.int64)  # see _rows
        self.scratch = torch.empty(B * cfg.n_head * cache.max_len)  # attention scores
        self.tok_w = model.tok_emb.weight.detach()
        self.pos_w = model.pos_emb.weight.detach() if model.pos_emb is not None else None
        self.rope = (rope_angles(0, cfg.context_length, cfg.head_dim, cfg.rope_theta)
                     if cfg.position == "rope" else None)  # row m: the angles at position m
        self.rope_pm = signed_sin(self.rope[1]).contiguous() if self.rope else None  # sin±
        self.qk_w = {id(n): self._ptr(n.weight) for b in model.blocks
                     for n in (b.attn.q_norm, b.attn.k_norm) if type(n) is RMSNorm}
        self.tmp = torch.empty(cfg.head_dim)
        self.blocks = [(b.ln1, self._linear(b.attn.qkv), self._linear(b.attn.out), b.ln2,
                        self._linear(b.ffn.gate) if isinstance(b.ffn, GatedFeedForward)
                        else None, self._linear(b.ffn.up), self._linear(b.ffn.down),
                        b.attn.q_norm, b.attn.k_norm,
                        isinstance(b.ffn, FeedForward) and isinstance(b.ffn.act, nn.GELU))
                       for b in model.blocks]
        self.final, self.head = model.final_norm, self._linear(model.lm_head)
        self.ln = {id(m): self._norm(m) for m in model.modules() if type(m) is nn.LayerNorm}
        self.rms = {id(m): self._ptr(m.weight) for m in model.modules()
                    if type(m) is RMSNorm and m.weight.shape == (cfg.n_embd,)}

    def _norm_rows(self, norm: nn.Module, x: Tensor, y: Tensor) -> None:
        """y = Norm(x): the native LayerNorm or RMSNorm (a few rows: one thread), or the
        module itself."""
        mean, rstd = self.stats
        if id(norm) in self.ln:
            w, b = self.ln[id(norm)]
            self.lib.tl_ln_fwd(x.data_ptr(), w, b, y.data_ptr(), mean.data_ptr(),
                               rstd.data_ptr(), self.B, self.E, norm.eps, 1)
        elif id(norm) in self.rms:
            self.lib.tl_rms_fwd(x.data_ptr(), self.rms[id(norm)], y.data_ptr(),
                                rstd.data_ptr(), self.B, self.E, norm.eps, 1)
        else:
            y.copy_(norm(x))

    def _qk(self, q_norm: nn.Module | None, k_norm: nn.Module | None) -> None:
        """q, k = RoPE(QKNorm(q)), RoPE(QKNorm(k)) in qkv, row b's heads at its position
        ``positions[b]``: natively where the norms are RMSNorm (or absent), else by the
        reference's modules and :func:`tinylm.core.attention.apply_rope`."""
        B, H, Hkv, D, qkv = self.B, self.H, self.Hkv, self.D, self.qkv
        if all(n is None or type(n) is RMSNorm for n in (q_norm, k_norm)):
            c = self.rope[0].data_ptr() if self.rope is not None else None
            s = self.rope_pm.data_ptr() if self.rope_pm is not None else None
            for off, n, norm in ((0, H, q_norm), (H * D, Hkv, k_norm)):
                self.lib.tl_rope_rows(qkv.data_ptr() + 4 * off, qkv.stride(0), B, n, D,
                                      self.qk_w[id(norm)] if norm is not None else None, c, s,
                                      self.positions.data_ptr(),
                                      norm.eps if norm is not None else 0.0,
                                      int(norm is not None), self.tmp.data_ptr())
            return
        q = qkv[:B, :H * D].view(B, H, D)
        k = qkv[:B, H * D:(H + Hkv) * D].view(B, Hkv, D)
        if q_norm is not None:
            q.copy_(q_norm(q))
            k.copy_(k_norm(k))
        if self.rope is not None:  # keys are cached rotated, as in the reference
            pos = self.positions[:B]
            cos, sin = self.rope[0][pos][:, None], self.rope[1][pos][:, None]  # (B, 1, D)
            q.copy_(apply_rope(q, cos, sin))
            k.copy_(apply_rope(k, cos, sin))

    def _attend(self, layer: int) -> None:
        """r = softmax(q·Kᵀ/√D)·V over the cache, each row over its own positions
        0..positions[b], the new k and v written into it; each group of H / H_kv query
        heads reads its one key/value head (csrc/decode.c: tl_attend_rows)."""
        kc, vc = self.cache.k[layer], self.cache.v[layer]  # (B, H_kv, max_len, D)
        self.lib.tl_attend_rows(self.qkv.data_ptr(), self.qkv.stride(0), kc.data_ptr(),
                                vc.data_ptr(), kc.stride(0), kc.stride(1), self.B, self.H,
                                self.Hkv, self.D, self.positions.data_ptr(), self.scale,
                                self.r.data_ptr(), self.scratch.data_ptr(),
                                self.cache.max_len, self.threads)

    def _ffn(self, h: Tensor, w_gate: tuple | None, w_up: tuple, gelu: bool) -> None:
        """u = the MLP's hidden activations of h."""
        g, u = self.g[:self.B], self.u[:self.B]
        if w_gate is not None:  # SwiGLU: u = SiLU(h·W_gateᵀ) ⊙ (h·W_upᵀ)
            self._mm(h, w_gate, g)
            self._mm(h, w_up, u)
            u.mul_(F.silu(g, inplace=True))
        elif gelu:
            self._mm(h, w_up, u, act=1)  # u = GELU(h·W_upᵀ + b)
        else:  # ReLU²
            self._mm(h, w_up, u)
            u.relu_().square_()

    def __call__(self, ids: Tensor, head: bool = True) -> Tensor | None:
        B = self._rows()
        if int(ids.min()) < 0 or int(ids.max()) >= self.V:
            raise ValueError(f"token ids must be in [0, {self.V}), got {ids.tolist()}")
        x, h, qkv = self.x[:B], self.h[:B], self.qkv[:B]
        torch.index_select(self.tok_w, 0, ids, out=x)
        if self.pos_w is not None:
            x += self.pos_w[self.positions[:B]]
        for layer, (ln1, w_qkv, w_out, ln2, w_gate, w_up, w_down, q_norm, k_norm,
                    gelu) in enumerate(self.blocks):
            self._norm_rows(ln1, x, h)  # h = Norm1(x)
            self._mm(h, w_qkv, qkv)  # [q | k | v] = h·W_qkvᵀ + b
            self._qk(q_norm, k_norm)  # q, k = RoPE(QKNorm(q)), RoPE(QKNorm(k))
            self._attend(layer)
            self._mm(self.r, w_out, x, res=x)  # x = x + r·W_outᵀ + b
            self._norm_rows(ln2, x, h)  # h = Norm2(x)
            self._ffn(h, w_gate, w_up, gelu)
            self._mm(self.u, w_down, x, res=x)  # x = x + u·W_downᵀ + b
        self.cache.advance(1)
        if not head:
            return None
        self._norm_rows(self.final, x, h)
        logits = torch.empty(B, self.V)
        self._mm(h, self.head, logits)
        return logits

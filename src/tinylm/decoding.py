"""The decoding step: one forward pass per generated token through the KV cache, fast.

:class:`Decoder` is what :mod:`tinylm.sampling` runs: ``prefill(ids)`` puts a prompt
(B, T) through the model in one pass, filling the cache, and ``step(ids)`` feeds one
token per row; both return the last position's logits (B, V). It picks the fastest
path the model and machine allow:

- **fused** (CPU, float32, tinylm's native kernel available, a standard :class:`GPT`):
  each step is a short sequence of calls into :mod:`tinylm.kernels`, with no module
  dispatch: per block LayerNorm, QKV, attention over the cache (writing the new key
  and value), the output projection with the residual add fused in, LayerNorm, the FFN
  up-projection with GELU fused in, and the down-projection with its residual add.
  It computes exactly the math of ``GPT.forward``; the tests hold it to the full
  forward. Weights are read once per step from a packed copy (cached across calls
  while the weights are unchanged).
- **fused-variant** (the same, for the architecture variants of
  ``ModelConfig``: RMSNorm, RoPE, QK-norm, SwiGLU/ReLU², grouped-query attention;
  :class:`_VariantStep`): the same native linear and attention calls, the norms,
  rotations and gates as in-place torch ops on the step's rows, and for GQA one
  attention call per row whose query heads read their shared cached key/value head.
- **patched** (CPU with the kernel, but a model whose layers were replaced, e.g. by
  :mod:`tinylm.lowrank`): the modules run as usual, with every ``nn.Linear`` routed
  through :class:`tinylm.kernels.PackedLinear` while decoding.
- **torch** (CUDA, or CPU without a C compiler): the model's own forward; on CPU the
  Linear weights are stored transposed-contiguous while decoding, the faster layout
  for MKL's few-row kernels.

The prompt pass always runs the model's own forward (big GEMMs, where BLAS is right).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tinylm import kernels
from tinylm.attention import KVCache, MultiHeadAttention, RMSNorm, rope_angles
from tinylm.model import GPT, Block, FeedForward, GatedFeedForward, ReLUSquared


class NativeKVCache(KVCache):
    """A KVCache whose one-token steps run :func:`tinylm.kernels.attend_one`: the new
    key/value written and every cached one read in one pass, no SDPA dispatch."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        _, B, H, max_len, _ = self.k.shape
        self.scratch = torch.empty(B * H * max_len)  # attention scores, (B·H, T)

    def attend(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        self.check_room(1)  # the kernel writes position `length` unchecked
        if q.dtype != torch.float32 or q.stride(-1) != 1 or k.shape[1] != q.shape[1]:
            return super().attend(layer, q, k, v)
        return kernels.attend_one(q, k, v, self.k[layer], self.v[layer], self.length,
                                  self.scratch)


def _native(model: nn.Module) -> bool:
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype == torch.float32
            and kernels.available())


def _standard(model: nn.Module) -> bool:
    """Whether ``model`` is a plain GPT whose every piece the fused step knows (GPT-2's
    layout: LayerNorm, learned positions, GELU, one key/value head per query head)."""
    if type(model) is not GPT or not model.config.gpt2_layout \
            or type(model.lm_head) is not nn.Linear:
        return False
    for block in model.blocks:
        if not (type(block) is Block and type(block.attn) is MultiHeadAttention
                and type(block.ffn) is FeedForward
                and type(block.attn.qkv) is nn.Linear and type(block.attn.out) is nn.Linear
                and type(block.ffn.up) is nn.Linear and type(block.ffn.down) is nn.Linear
                and type(block.ffn.act) is nn.GELU and block.ffn.act.approximate == "tanh"
                and type(block.ln1) is nn.LayerNorm and type(block.ln2) is nn.LayerNorm):
            return False
    return all(p.is_contiguous() for p in model.parameters())


def _variant(model: nn.Module) -> bool:
    """Whether ``model`` is a GPT of any architecture variant whose every piece
    :class:`_VariantStep` knows: plain Linear/Embedding layers, LayerNorm or RMSNorm,
    GELU/ReLU² or SwiGLU MLPs, any n_kv_head, RoPE or learned positions, QK-norm."""
    if type(model) is not GPT or type(model.lm_head) is not nn.Linear \
            or type(model.tok_emb) is not nn.Embedding:
        return False
    norms = (nn.LayerNorm, RMSNorm)
    for block in model.blocks:
        attn, ffn = block.attn, block.ffn
        linears = [attn.qkv, attn.out, ffn.up, ffn.down] + (
            [ffn.gate] if type(ffn) is GatedFeedForward else [])
        if not (type(block) is Block and type(attn) is MultiHeadAttention
                and all(type(m) is nn.Linear for m in linears)
                and type(block.ln1) in norms and type(block.ln2) in norms
                and (type(ffn) is GatedFeedForward or (
                    type(ffn) is FeedForward and (type(ffn.act) is ReLUSquared or (
                        type(ffn.act) is nn.GELU and ffn.act.approximate == "tanh"))))
                and (attn.q_norm is None or type(attn.q_norm) is RMSNorm)):
            return False
    return type(model.final_norm) in norms and all(p.is_contiguous()
                                                     for p in model.parameters())


class Decoder:
    """Prefill and one-token steps of ``model`` for ``batch_size`` rows (see the module
    docstring for the paths). Use as a context manager, or call :meth:`close`: the
    patched and torch paths change the model's modules while decoding."""

    def __init__(self, model: GPT, batch_size: int) -> None:
        self.model = model
        self._fused: _FusedStep | _VariantStep | None = None
        native = _native(model)
        cache_type = NativeKVCache if native else KVCache
        self.cache = cache_type.for_model(model, batch_size)  # max_len = context length
        self._restore: Callable[[], None] | None = None
        if native and _standard(model):
            self.path = "fused"
            self._fused = _FusedStep(model, self.cache)
        elif native and _variant(model):
            self.path = "fused-variant"
            self._fused = _VariantStep(model, self.cache)
        elif native:
            self.path = "patched"
            self._restore = _route_linears(model)
        else:
            self.path = "torch"
            if next(model.parameters()).device.type == "cpu":
                self._restore = _transposed_layout(model)

    def prefill(self, ids: Tensor) -> Tensor:
        """Restart the cache on ids (B, T), T <= context length; logits of the last
        position, (B, V). Only the last row goes through the LM head."""
        self.cache.reset()
        h = self.model.hidden_states(ids, self.cache)  # (B, T, E)
        return self.model.lm_head(h[:, -1])  # (B, E) -> (B, V)

    def step(self, ids: Tensor) -> Tensor:
        """Next token of every row, ids (B,) -> logits (B, V); the cache must have room."""
        self.cache.check_room(1)
        if self._fused is not None:
            return self._fused(ids)
        return self.model(ids.unsqueeze(1), self.cache)[:, -1]  # (B, 1) -> (B, V)

    def close(self) -> None:
        if self._restore is not None:
            self._restore()
            self._restore = None

    def __enter__(self) -> Decoder:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _FusedStep:
    """``GPT.forward`` for one token per row through the cache, as native kernel calls.

    Every buffer is allocated once; a step allocates only its logits. Each kernel call
    names the equation it computes (shapes as in attention.py, B rows)."""

    def __init__(self, model: GPT, cache: NativeKVCache) -> None:
        cfg = model.config
        self.lib = kernels.load()
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
        self.stats = torch.empty(2, B)  # LayerNorm's per-row mean and 1/std (unused)
        self.keep = []  # packed weights and contiguous biases the pointers refer to
        self.tok, self.pos = self._ptr(model.tok_emb.weight), self._ptr(model.pos_emb.weight)
        self.blocks = [
            (self._norm(b.ln1), self._linear(b.attn.qkv), self._linear(b.attn.out),
             self._norm(b.ln2), self._linear(b.ffn.up), self._linear(b.ffn.down))
            for b in model.blocks]
        self.final_norm = self._norm(model.final_norm)
        self.head = self._linear(model.lm_head)

    def _ptr(self, t: Tensor | None) -> int | None:
        if t is None:
            return None
        t = t.detach().contiguous()
        self.keep.append(t)
        return t.data_ptr()

    def _norm(self, ln: nn.LayerNorm) -> tuple[int | None, int | None]:
        return self._ptr(ln.weight), self._ptr(ln.bias)

    def _linear(self, lin: nn.Linear) -> tuple[int, int | None, int, int]:
        packed = kernels.packed_weight(lin.weight)
        self.keep.append(packed)
        return packed.data_ptr(), self._ptr(lin.bias), lin.in_features, lin.out_features

    def _mm(self, x: Tensor, lin: tuple, y: Tensor, act: int = 0,
            res: Tensor | None = None) -> None:
        packed, bias, I, O = lin
        self.lib.tl_linear(x.data_ptr(), I, packed, bias, y.data_ptr(), self.B, I, O,
                           self.threads, act, res.data_ptr() if res is not None else None)

    def _ln(self, x: Tensor, norm: tuple, y: Tensor) -> None:
        mean, rstd = self.stats  # a few rows: one thread, no parallel region to start
        self.lib.tl_ln_fwd(x.data_ptr(), norm[0], norm[1], y.data_ptr(), mean.data_ptr(),
                           rstd.data_ptr(), self.B, self.E, self.eps, 1)

    def __call__(self, ids: Tensor) -> Tensor:
        cache, lib = self.cache, self.lib
        pos = cache.length  # Decoder.step checked that it is < max_len
        B, H, D = self.B, self.H, self.D
        HD = H * D
        self.ids.copy_(ids)
        x, h, qkv, r, u = self.x, self.h, self.qkv, self.r, self.u
        if lib.tl_embed(self.ids.data_ptr(), self.tok, self.pos, pos, x.data_ptr(), B,
                        self.E, self.V):
            raise ValueError(f"token ids must be in [0, {self.V}), got {ids.tolist()}")
        q_ptr = qkv.data_ptr()  # [q | k | v], each H heads of D: strides (3·H·D, D)
        k_ptr, v_ptr = q_ptr + 4 * HD, q_ptr + 8 * HD  # float32: 4 bytes
        for layer, (ln1, w_qkv, w_out, ln2, w_up, w_down) in enumerate(self.blocks):
            self._ln(x, ln1, h)  # h = LN1(x)
            self._mm(h, w_qkv, qkv)  # [q | k | v] = h·W_qkvᵀ + b
            kc, vc = cache.k[layer], cache.v[layer]  # (B, H, max_len, D)
            lib.tl_attend_one(q_ptr, 3 * HD, D, k_ptr, 3 * HD, D, v_ptr, 3 * HD, D,
                              kc.data_ptr(), vc.data_ptr(), kc.stride(0), kc.stride(1),
                              B, H, D, pos, self.scale, r.data_ptr(),
                              cache.scratch.data_ptr(), self.threads)  # r = softmax(qKᵀ/√D)V
            self._mm(r, w_out, x, res=x)  # x = x + r·W_outᵀ + b
            self._ln(x, ln2, h)  # h = LN2(x)
            self._mm(h, w_up, u, act=1)  # u = GELU(h·W_upᵀ + b)
            self._mm(u, w_down, x, res=x)  # x = x + u·W_downᵀ + b
        cache.advance(1)
        self._ln(x, self.final_norm, h)
        logits = torch.empty(B, self.V)
        self._mm(h, self.head, logits)  # logits = h·W_headᵀ (tied: the token embedding)
        return logits


class _VariantStep(_FusedStep):
    """:class:`_FusedStep` for the architecture variants: the same native linear and
    attention calls, with RMSNorm, RoPE, QK-norm and the SwiGLU/ReLU² MLPs as a few
    in-place torch ops on the step's (B, ·) rows, and grouped-query attention as one
    attention call per row whose query heads share each cached key/value head."""

    def __init__(self, model: GPT, cache: NativeKVCache) -> None:  # noqa: PLR0915
        cfg = model.config
        self.lib, self.cache, self.model = kernels.load(), cache, model
        B = self.B = cache.k.shape[1]
        self.E, self.H, self.Hkv, self.D = cfg.n_embd, cfg.n_head, cfg.n_kv_head, cfg.head_dim
        self.V, self.scale = cfg.vocab_size, 1.0 / math.sqrt(cfg.head_dim)
        self.threads = torch.get_num_threads()
        self.keep = []
        HD, KD = cfg.inner_dim, cfg.kv_dim
        self.x, self.h = torch.empty(B, cfg.n_embd), torch.empty(B, cfg.n_embd)
        self.qkv, self.r = torch.empty(B, HD + 2 * KD), torch.empty(B, HD)
        self.g, self.u = torch.empty(B, cfg.ffn_dim), torch.empty(B, cfg.ffn_dim)
        self.stats = torch.empty(2, B)
        # Scores of one row's H query heads (the cache's own scratch has H_kv heads).
        self.scratch = torch.empty(cfg.n_head * cache.max_len)
        self.tok_w = model.tok_emb.weight.detach()
        self.pos_w = model.pos_emb.weight.detach() if model.pos_emb is not None else None
        # RoPE's cos/sin of every position, the same values rope_angles gives per step.
        self.rope = (rope_angles(0, cfg.context_length, cfg.head_dim, cfg.rope_theta)
                     if cfg.position == "rope" else None)
        self.blocks = [
            (b.ln1, self._linear(b.attn.qkv), self._linear(b.attn.out), b.ln2,
             self._linear(b.ffn.gate) if type(b.ffn) is GatedFeedForward else None,
             self._linear(b.ffn.up), self._linear(b.ffn.down), b.attn.q_norm, b.attn.k_norm,
             type(b.ffn) is FeedForward and type(b.ffn.act) is nn.GELU)
            for b in model.blocks]
        self.final = model.final_norm
        self.head = self._linear(model.lm_head)
        self.ln_ptrs = {id(m): self._norm(m) for m in model.modules()
                        if type(m) is nn.LayerNorm}

    def _norm_rows(self, norm: nn.Module, x: Tensor, y: Tensor) -> None:
        if type(norm) is nn.LayerNorm:
            mean, rstd = self.stats
            w, b = self.ln_ptrs[id(norm)]
            self.lib.tl_ln_fwd(x.data_ptr(), w, b, y.data_ptr(), mean.data_ptr(),
                               rstd.data_ptr(), self.B, self.E, norm.eps, 1)
        else:  # RMSNorm's own formula, as in the module
            y.copy_(norm(x))

    def _rotate(self, t: Tensor, pos: int) -> None:
        """RoPE of one position in place on t (B, heads, D), as attention.apply_rope."""
        cos, sin = self.rope[0][pos], self.rope[1][pos]
        half = self.D // 2
        t1, t2 = t[..., :half].clone(), t[..., half:].clone()
        t[..., :half] = t1 * cos[:half] - t2 * sin[:half]
        t[..., half:] = t2 * cos[half:] + t1 * sin[half:]

    def _attend(self, layer: int, pos: int) -> None:
        lib, cache, B, H, Hkv, D = self.lib, self.cache, self.B, self.H, self.Hkv, self.D
        W = self.qkv.shape[1]
        q_ptr = self.qkv.data_ptr()  # [q | k | v] rows of W floats
        k_ptr, v_ptr = q_ptr + 4 * H * D, q_ptr + 4 * (H + Hkv) * D
        kc, vc = cache.k[layer], cache.v[layer]  # (B, H_kv, max_len, D)
        if Hkv == H:
            lib.tl_attend_one(q_ptr, W, D, k_ptr, W, D, v_ptr, W, D, kc.data_ptr(),
                              vc.data_ptr(), kc.stride(0), kc.stride(1), B, H, D, pos,
                              self.scale, self.r.data_ptr(), cache.scratch.data_ptr(),
                              self.threads)
            return
        rep = H // Hkv  # per row: H_kv groups of rep query heads sharing one key/value head
        for b in range(B):
            off = 4 * b * W
            lib.tl_attend_one(q_ptr + off, rep * D, D, k_ptr + off, D, 0, v_ptr + off, D, 0,
                              kc[b].data_ptr(), vc[b].data_ptr(), kc.stride(1), 0, Hkv, rep,
                              D, pos, self.scale, self.r[b].data_ptr(),
                              self.scratch.data_ptr(), self.threads)

    def __call__(self, ids: Tensor) -> Tensor:
        cache, B, H, Hkv, D = self.cache, self.B, self.H, self.Hkv, self.D
        pos = cache.length
        if int(ids.min()) < 0 or int(ids.max()) >= self.V:
            raise ValueError(f"token ids must be in [0, {self.V}), got {ids.tolist()}")
        x, h, qkv, g, u = self.x, self.h, self.qkv, self.g, self.u
        torch.index_select(self.tok_w, 0, ids, out=x)
        if self.pos_w is not None:
            x += self.pos_w[pos]
        q = qkv[:, :H * D].view(B, H, D)
        k = qkv[:, H * D:(H + Hkv) * D].view(B, Hkv, D)
        for layer, (ln1, w_qkv, w_out, ln2, w_gate, w_up, w_down, q_norm, k_norm,
                    gelu) in enumerate(self.blocks):
            self._norm_rows(ln1, x, h)  # h = Norm1(x)
            self._mm(h, w_qkv, qkv)  # [q | k | v] = h·W_qkvᵀ + b
            if q_norm is not None:
                q.copy_(q_norm(q))
                k.copy_(k_norm(k))
            if self.rope is not None:
                self._rotate(q, pos)
                self._rotate(k, pos)  # cached rotated, as in the reference
            self._attend(layer, pos)  # r = softmax(qKᵀ/√D)V, k and v written to the cache
            self._mm(self.r, w_out, x, res=x)  # x = x + r·W_outᵀ + b
            self._norm_rows(ln2, x, h)  # h = Norm2(x)
            if w_gate is not None:  # SwiGLU: u = SiLU(h·W_gateᵀ) ⊙ (h·W_upᵀ)
                self._mm(h, w_gate, g)
                self._mm(h, w_up, u)
                u.mul_(F.silu(g, inplace=True))
            elif gelu:
                self._mm(h, w_up, u, act=1)  # u = GELU(h·W_upᵀ + b)
            else:  # ReLU²
                self._mm(h, w_up, u)
                u.relu_().square_()
            self._mm(u, w_down, x, res=x)  # x = x + u·W_downᵀ + b
        cache.advance(1)
        self._norm_rows(self.final, x, h)
        logits = torch.empty(B, self.V)
        self._mm(h, self.head, logits)
        return logits


def _route_linears(model: nn.Module) -> Callable[[], None]:
    """Give every float32 ``nn.Linear`` a :class:`~tinylm.kernels.PackedLinear` forward
    (steps of at most 16 rows go through the native kernel). Returns the undo."""
    patched = []
    for module in model.modules():
        if isinstance(module, nn.Linear) and kernels.supports(module.weight):
            module.forward = kernels.PackedLinear(module.weight, module.bias)
            patched.append(module)

    def restore() -> None:
        for module in patched:
            module.__dict__.pop("forward", None)  # back to nn.Linear.forward
    return restore


def _transposed_layout(model: nn.Module) -> Callable[[], None]:
    """Store every Linear weight W (O, I) as the transpose of a contiguous (I, O) copy.

    Same values and shape, other strides: F.linear(x, W) then runs as x·Wᵀ over a
    row-major (I, O) matrix, which MKL's CPU kernels stream faster than the (O, I)
    layout for the few-row inputs of a decoding step (the layout Hugging Face's GPT-2
    Conv1D keeps). Costs one copy of the weights while decoding. Returns the undo.
    """
    originals = []
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear) and module.weight.is_contiguous():
                originals.append((module, module.weight.data))
                module.weight.data = module.weight.data.t().contiguous().t()  # (O,I) as (I,O)ᵀ

    def restore() -> None:
        for linear, weight in originals:
            linear.weight.data = weight
    return restore


"""The torch twin of `dhp_jax.model.mllm`: the same multimodal model, op for op, in torch.

The architecture has one source of truth, `MLLMConfig` and the math written in the flax module's
docstring; this module mirrors it (module names follow the flax parameter tree, so the weight
mapping in `npu_backend.weights` is mechanical). Every token-local op runs on the local shard; the
two attention calls (vision encoder, decoder) go through the `attn` callable the caller hands in:
`ring_attention` over the CP group, or dense attention on one rank.

Inputs are one (shard of a) packed stream, as `dhp_jax.geometry.layout` builds it: `token_ids[S]`,
`pixels[S, P]`, `vision_mask[S]`, `segment_ids, positions, span_ids, frame_ids, frame_positions[S]`.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

# attn(q[S, H, D], k[S, KVH, D], v[S, KVH, D], ids[S, 3]) -> o[S, H, D]; ids = (segment, position, span)
AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# Tensor parallelism (`npu_backend.tensor_parallel.TensorParallel.shard`) sets `tp` on the attention and MLP
# modules and on the model: `tp.enter` before a column-parallel matrix, `tp.exit` after a row-parallel
# one (Megatron's f and g), `tp.embed` the vocab-parallel lookup; `tp = None` is one device per rank.
# With `tp.sequence` (sequence parallelism, arXiv 2205.05198) the block stacks carry this process's
# rows only (`tp.rows` / `tp.stream` around them; `Block.sequence_forward`).



def attention_mask(q_ids: torch.Tensor, k_ids: torch.Tensor) -> torch.Tensor:
    """bool[S_q, S_k] from ids[S, 3] = (segment, position, span), as `dhp_jax.model.attention`:

    allowed = same segment, segment > 0 (0 is padding), and (causal by position, or the same
    bidirectional span > 0).
    """
    seg_q, pos_q, span_q = q_ids[:, 0, None], q_ids[:, 1, None], q_ids[:, 2, None]
    seg_k, pos_k, span_k = k_ids[None, :, 0], k_ids[None, :, 1], k_ids[None, :, 2]
    same = (seg_q == seg_k) & (seg_q > 0)
    return same & ((pos_k <= pos_q) | ((span_q == span_k) & (span_q > 0)))


def dense_attn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Single-rank attention over the whole stream (rows with no allowed key give zeros)."""
    from npu_backend.ring import ring_attention

    return ring_attention(q, k, v, ids, attention_mask)


def rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    """Rotate-half rotary embedding of x[S, H, D] at integer positions pos[S]."""
    d = x.shape[-1]
    exps = -torch.arange(0, d // 2, dtype=torch.float32, device=x.device) * 2.0 / d
    inv_freq = torch.tensor(base, dtype=torch.float32, device=x.device) ** exps
    ang = pos.to(torch.float32)[:, None] * inv_freq[None, :]          # ang[S, D/2]
    cos = torch.cat([torch.cos(ang), torch.cos(ang)], dim=-1)[:, None, :]
    sin = torch.cat([torch.sin(ang), torch.sin(ang)], dim=-1)[:, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps) * self.scale


class Attention(nn.Module):
    tp = None

    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, rope_base: float):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.rope_base = heads, kv_heads, head_dim, rope_base
        self.q = nn.Linear(dim, heads * head_dim, bias=False)
        self.k = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.v = nn.Linear(dim, kv_heads * head_dim, bias=False)
        self.o = nn.Linear(heads * head_dim, dim, bias=False)

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q[S, H, D], k, v[S, KVH, D] of (normed) rows x at positions pos, rotary applied."""
        s = x.shape[0]
        if self.tp is not None:
            x = self.tp.enter(x)
        q = self.q(x).reshape(s, self.heads, self.head_dim)
        k = self.k(x).reshape(s, self.kv_heads, self.head_dim)
        v = self.v(x).reshape(s, self.kv_heads, self.head_dim)
        return rope(q, pos, self.rope_base), rope(k, pos, self.rope_base), v

    def out(self, o: torch.Tensor) -> torch.Tensor:
        """The output projection of o[S, H, D] (row-parallel under tensor parallelism)."""
        y = self.o(o.reshape(o.shape[0], self.heads * self.head_dim))
        return y if self.tp is None else self.tp.exit(y)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        q, k, v = self.project(x, ids[:, 1])
        return self.out(attn(q, k, v, ids))


class SwiGLU(nn.Module):
    tp = None

    def __init__(self, dim: int, d_ff: int):
        super().__init__()
        self.gate = nn.Linear(dim, d_ff, bias=False)
        self.up = nn.Linear(dim, d_ff, bias=False)
        self.down = nn.Linear(d_ff, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.down(F.silu(self.gate(x)) * self.up(x))
        x = self.tp.enter(x)
        return self.tp.exit(self.down(F.silu(self.gate(x)) * self.up(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int, head_dim: int, d_ff: int, rope_base: float,
                 eps: float):
        super().__init__()
        self.attn_norm = RMSNorm(dim, eps)
        self.attn = Attention(dim, heads, kv_heads, head_dim, rope_base)
        self.mlp_norm = RMSNorm(dim, eps)
        self.mlp = SwiGLU(dim, d_ff)

    def forward(self, x: torch.Tensor, ids: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        """h = x + attn(attn_norm(x)); out = h + mlp(mlp_norm(h)) on the live rows (ids segment > 0:
        real tokens in the decoder, vision tokens in the vision encoder) only: the linear layers
        skip padding, attention sees zero q/k/v there, and dead rows pass x through (as the JAX
        model's skipped chunks; nothing reads them)."""
        live = torch.nonzero(ids[:, 0] > 0, as_tuple=True)[0]
        if live.numel() == x.shape[0]:
            h = x + self.attn(self.attn_norm(x), ids, attn)
            return h + self.mlp(self.mlp_norm(h))
        xl = x[live]
        qkv = self.attn.project(self.attn_norm(xl), ids[live, 1])
        q, k, v = (t.new_zeros((x.shape[0],) + t.shape[1:]).index_copy(0, live, t) for t in qkv)
        h = xl + self.attn.out(attn(q, k, v, ids)[live])
        return x.index_copy(0, live, h + self.mlp(self.mlp_norm(h)))

    def sequence_forward(self, x: torch.Tensor, ids: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        """`forward` under sequence parallelism (Megatron-LM, arXiv 2205.05198, sec. 4.2.2): x is this
        process's rows of the stream (`TensorParallel.rows`), ids whole. The norms and residuals run on
        those rows; a norm's output is all-gathered over the rank before q/k/v (gate/up), which run on
        the live rows of the whole stream with this process's heads (MLP width), and the partial
        outputs of o (down) are reduce-scattered back to the rows. Dead rows get zero updates (x passes
        through, as in `forward`)."""
        a, m, tp, s = self.attn, self.mlp, self.attn.tp, ids.shape[0]
        live = torch.nonzero(ids[:, 0] > 0, as_tuple=True)[0]
        rows = None if live.numel() == s else live

        def whole(y: torch.Tensor) -> torch.Tensor:     # live rows -> the stream's s rows (zeros elsewhere)
            return y if rows is None else y.new_zeros((s,) + y.shape[1:]).index_copy(0, rows, y)

        q, k, v = tp.gather_linear(self.attn_norm(x), s, [(a.q.weight, None), (a.k.weight, None),
                                                          (a.v.weight, None)], rows)
        n, pos = q.shape[0], ids[:, 1] if rows is None else ids[rows, 1]
        q = rope(q.reshape(n, a.heads, a.head_dim), pos, a.rope_base)
        k = rope(k.reshape(n, a.kv_heads, a.head_dim), pos, a.rope_base)
        o = attn(whole(q), whole(k), whole(v.reshape(n, a.kv_heads, a.head_dim)), ids)
        o = o if rows is None else o[rows]
        h = x + tp.scatter(whole(F.linear(o.reshape(n, a.heads * a.head_dim), a.o.weight)))
        gate, up = tp.gather_linear(self.mlp_norm(h), s, [(m.gate.weight, None), (m.up.weight, None)], rows)
        return h + tp.scatter(whole(F.linear(F.silu(gate) * up, m.down.weight)))


class TorchMLLM(nn.Module):
    """Vision encoder + projector + decoder over a (shard of a) packed stream; returns logits[S, V].

    `config` is a `dhp_jax.model.MLLMConfig` (or any object with the same fields). Under tensor
    parallelism the logits are this device's vocabulary columns (`tp.vocab_range`).
    """

    tp = None

    def __init__(self, config) -> None:
        super().__init__()
        c = self.config = config
        self.embed = nn.Embedding(c.vocab_size, c.d_model)
        self.patch_embed = nn.Linear(c.patch_dim, c.vision_dim)
        self.vision_layers = nn.ModuleList(
            Block(c.vision_dim, c.vision_heads, c.vision_heads, c.vision_head_dim, c.vision_ff, c.rope_base,
                  c.rms_eps) for _ in range(c.vision_layers))
        self.vision_norm = RMSNorm(c.vision_dim, c.rms_eps)
        self.proj_fc1 = nn.Linear(c.vision_dim, c.d_model)
        self.proj_fc2 = nn.Linear(c.d_model, c.d_model)
        self.layers = nn.ModuleList(
            Block(c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, c.d_ff, c.rope_base, c.rms_eps)
            for _ in range(c.num_layers))
        self.final_norm = RMSNorm(c.d_model, c.rms_eps)
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.reset_parameters(torch.Generator().manual_seed(0))

    @torch.no_grad()
    def reset_parameters(self, gen: torch.Generator) -> None:
        """flax's default initialisation: lecun-normal kernels (truncated), zero biases, unit norms.

        The draws differ from flax's (another RNG); only the distributions match. Load flax
        weights with `npu_backend.weights.load_flax_params` to get the very same model.
        """
        for mod in self.modules():
            if isinstance(mod, nn.Linear):
                std = 1.0 / math.sqrt(mod.in_features) / 0.87962566103423978  # truncated-normal correction
                nn.init.trunc_normal_(mod.weight, std=std, a=-2 * std, b=2 * std, generator=gen)
                if mod.bias is not None:
                    mod.bias.zero_()
            elif isinstance(mod, nn.Embedding):
                # flax nn.Embed: variance_scaling(1.0, "fan_in", "normal", out_axis=0) -> std 1/sqrt(d)
                nn.init.normal_(mod.weight, std=1.0 / math.sqrt(mod.embedding_dim), generator=gen)
            elif isinstance(mod, RMSNorm):
                mod.scale.fill_(1.0)

    def forward(self, batch: Mapping[str, torch.Tensor], attn: AttnFn = dense_attn) -> torch.Tensor:
        vis_ids = torch.stack([batch["frame_ids"], batch["frame_positions"], batch["frame_ids"]], dim=1).long()
        v = self.stack(self.vision_layers, self.patch_embed(batch["pixels"]), vis_ids, attn)
        v = self.vision_norm(v)
        v = self.proj_fc2(F.gelu(self.proj_fc1(v), approximate="none"))
        t = self.embed(batch["token_ids"].long()) if self.tp is None else self.tp.embed(self.embed.weight,
                                                                                         batch["token_ids"].long())
        x = torch.where(batch["vision_mask"].bool()[:, None], v, t)
        ids = torch.stack([batch["segment_ids"], batch["positions"], batch["span_ids"]], dim=1).long()
        x = self.final_norm(self.stack(self.layers, x, ids, attn))
        return self.lm_head(x if self.tp is None else self.tp.enter(x))

    def stack(self, blocks: nn.ModuleList, x: torch.Tensor, ids: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        """The blocks over the whole stream x[S, d]; sequence-parallel (`tp.sequence`), on this
        process's rows between the stream's split (`tp.rows`) and all-gather (`tp.stream`), as the JAX
        engine's block stacks (`dhp_jax.model.mllm.sequence_rows` / `sequence_stream`)."""
        if self.tp is None or not self.tp.sequence or not len(blocks):
            for blk in blocks:
                x = blk(x, ids, attn)
            return x
        rows = self.tp.rows(x)
        for blk in blocks:
            rows = blk.sequence_forward(rows, ids, attn)
        return self.tp.stream(rows, x.shape[0])


def token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Sum over tokens of weight * cross entropy(logits, target) (a scalar)."""
    lse = torch.logsumexp(logits, dim=-1)
    picked = torch.gather(logits, -1, targets.long()[:, None])[:, 0]
    return torch.sum((lse - picked) * weights.to(logits.dtype))

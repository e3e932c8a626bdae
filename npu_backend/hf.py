"""The Hugging Face families (Qwen2.5-VL, Qwen3-VL, InternVL) in torch: the twin of the JAX forward
pass over the packed streams (`dhp_jax.model.hf.packed_forward`), op for op.

The parameters are a flat `{transformers name: tensor}` dict, loaded from the same checkpoint
directory as `dhp_jax.model.hf.load_pretrained` (config.json + safetensors, read by the project's
own NumPy reader, memory-mapped, tensor by tensor; transformers is not needed), so gradients are
named exactly as transformers' `state_dict()` names them (a tied LM head once, as the embedding).
The config is the same `HFConfig` (`dhp_jax.model.hf.families.parse_config`), the streams the
same `pack_family_group` arrays, sharded alike: every token-local op runs on the local shard, and
every attention call (the LLM's and the vision encoder's) goes through the `attn` callable the
caller hands in, with the ids of `npu_backend.model.attention_mask`: the LLM (segment = 1 +
sample, position = offset in the sample, span 0: causal), the encoders (segment = span = frame,
window or tile id: bidirectional inside it, dead rows segment 0).

Mixture-of-experts LLMs (Qwen3-VL-MoE, InternVL with a Qwen3-MoE LLM): the layers `config.text.moe`
marks sparse run the sparse block of `npu_backend.moe` instead of the dense MLP; the experts are
held fused as transformers holds them (`gate_up_proj` [E, 2 I, d], `down_proj` [E, d, I]), read
from per-expert or transposed checkpoints and written in the family's published layout
(`dhp_jax.model.hf.checkpoint.saved_weights`, the JAX saver's function).

Layout of this module: the shared blocks (norms, linear, rotary, the LLM decoder block, the Qwen
vision attention), then the LLM over the stream and the loss. Each family's encoder (its
differences, in one place) is its `torch_model.encode` (`dhp_jax.models.<family>`,
`FamilySpec.torch_module`): (model, vision int columns, pixels [S*unit, patch_dim], tap weights
[S*unit, taps], attn) -> (merged features [S, d], DeepStack features: a list of [S, d]).
"""

from __future__ import annotations

import os
from typing import Callable, Iterator, Mapping

import numpy as np
import torch
import torch.nn.functional as F

from dhp_jax.data.hf_config import checkpoint_dir
from dhp_jax.data.sample import Sample
from dhp_jax.model.hf import safetensors_io
from dhp_jax.model.hf.checkpoint import rename, saved_weights
from dhp_jax.model.hf.config import HFConfig, read_config_json, write_pretrained
from dhp_jax import models
from dhp_jax.model.hf.families import family, hf_module, parse_config
from dhp_jax.model.hf.packed import LLM_INTS, VISION_INTS, FamilyLayout, pack_family_group, patch_dim
from dhp_jax.model.hf.spec import RopeSpec
from npu_backend import moe
from npu_backend.model import AttnFn, dense_attn

LM_HEAD = "lm_head.weight"

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": lambda x: F.gelu(x, approximate="none"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x),
}


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name not in ACTIVATIONS:
        raise ValueError(f"activation {name!r} is not supported (known: {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name]


class TorchFamilyModel:
    """One model of a supported family: `config` (an `HFConfig`) and `params`, leaf tensors
    (requires_grad) by transformers name. `parameters()` / `named_parameters()` as a torch module
    has them, so `npu_backend.executor` all-reduces their gradients.

    Under tensor parallelism (`npu_backend.tensor_parallel.TensorParallel.shard` sets `tp`) the LLM and the
    vision encoder's blocks are split Megatron-style (their attention and MLP matrices; the
    embedding and the LM head vocab-parallel), the patch embedding, the norms, the mergers and the
    projector replicated; `params` then hold this process's slices. With sequence parallelism
    (`tp.sequence`) the blocks of both run on this process's rows of their stream (`split_rows`,
    `column`, `row_linear`, `join_rows`)."""

    tp = None
    router_stats: list = []     # `npu_backend.moe.RouterStats` of each sparse block, the last forward pass

    def __init__(self, config: HFConfig, weights: Mapping[str, torch.Tensor]):
        if not isinstance(config, HFConfig):
            raise TypeError(f"config must be an HFConfig (dhp_jax.model.hf), got {type(config).__name__}")
        self.config = config
        self.params = {k: torch.nn.Parameter(torch.as_tensor(weights[k]).detach().clone()) for k in sorted(weights)}
        need = ["model.language_model.embed_tokens.weight", "model.language_model.norm.weight"]
        need += [] if config.tied else [LM_HEAD]
        missing = [k for k in need if k not in self.params]
        if missing:
            raise ValueError(f"{config.family} weights lack {missing}")

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self.params.values())

    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        return iter(self.params.items())

    def grads(self) -> dict[str, np.ndarray]:
        """{transformers name: gradient} (zeros where none was computed)."""
        return {k: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().cpu().numpy()
                for k, p in self.params.items()}

    # ------------------------------------------------------------------ blocks on named weights
    def w(self, name: str) -> torch.Tensor:
        if name not in self.params:
            raise KeyError(f"{self.config.family}: no weight {name!r} in the checkpoint")
        return self.params[name]

    def linear(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """x @ weight.T (+ bias when the checkpoint has one); a patch Conv weight is flattened."""
        w = self.w(prefix + ".weight")
        return F.linear(x, w.reshape(w.shape[0], -1), self.params.get(prefix + ".bias"))

    def rms_norm(self, prefix: str, x: torch.Tensor, eps: float, per_head: bool = False) -> torch.Tensor:
        """RMSNorm over the last axis. `per_head`: a scale shared by the heads of x[S, H, D] (the
        LLM's q/k norms); under tensor parallelism each process sees its heads only, so the scale's
        gradient is summed over the rank (Megatron's f on the weight)."""
        xf = x.float()
        y = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + eps)
        w = self.w(prefix + ".weight")
        return (w if not per_head or self.tp is None else self.tp.enter(w)) * y.to(x.dtype)

    def layer_norm(self, prefix: str, x: torch.Tensor, eps: float) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], self.w(prefix + ".weight"), self.w(prefix + ".bias"), eps)

    def decoder_block(self, prefix: str, x: torch.Tensor, angles: torch.Tensor, ids: torch.Tensor,
                      attn: AttnFn, sparse: bool = False) -> torch.Tensor:
        """One pre-norm LLM block (`dhp_jax.model.hf.layers.decoder_block`); under sequence parallelism x
        is this process's rows of the stream (`split_rows`), ids and angles whole. `sparse`: its MLP
        is the sparse MoE block (`sparse_mlp`)."""
        shape, s, tp = self.config.text.shape, ids.shape[0], self.tp
        heads, kv = shape.num_heads, shape.num_kv_heads
        if tp is not None:       # this process's heads (a kv head replicated when kv < t)
            heads, kv = heads // tp.size, max(1, kv // tp.size)
        a = prefix + ".self_attn"
        y = self.rms_norm(prefix + ".input_layernorm", x, shape.eps)
        q, k, v = self.column(y, [a + ".q_proj", a + ".k_proj", a + ".v_proj"], s)
        q, k, v = q.reshape(s, heads, shape.head_dim), k.reshape(s, kv, shape.head_dim), v.reshape(s, kv, shape.head_dim)
        if shape.qk_norm:
            q, k = self.rms_norm(a + ".q_norm", q, shape.eps, True), self.rms_norm(a + ".k_norm", k, shape.eps, True)
        o = attn(rope(q, angles), rope(k, angles), v, ids)
        h = x + self.row_linear(a + ".o_proj", o.reshape(s, heads * shape.head_dim))
        z = self.rms_norm(prefix + ".post_attention_layernorm", h, shape.eps)
        if sparse:
            return h + self.sparse_mlp(prefix, z, ids[:, 0] > 0)
        act, m = activation(shape.act), prefix + ".mlp"
        gate, up = self.column(z, [m + ".gate_proj", m + ".up_proj"], s)
        return h + self.row_linear(m + ".down_proj", act(gate) * up)

    def sparse_mlp(self, prefix: str, z: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
        """The sparse MoE block (`npu_backend.moe`) of a block's normed stream z (this process's rows
        under sequence parallelism; whole otherwise, and then split into the rows sequence
        parallelism would hold for the experts' exchange, and joined after it); `live` [S]: the
        stream's live rows, whose routing `router_stats` collects."""
        spec, tp, s = self.config.text.moe, self.tp, live.shape[0]
        rows = z if self.sequence or tp is None else tp.rows(z)
        live = live if tp is None else tp.local_rows(live)
        y, stats = moe.sparse_block(rows, self.w(f"{prefix}.{moe.GATE}"), self.w(f"{prefix}.{moe.GATE_UP}"),
                                    self.w(f"{prefix}.{moe.DOWN}"), spec.top_k, spec.norm_topk_prob,
                                    activation(self.config.text.shape.act), tp, live)
        self.router_stats.append(stats)
        return y if self.sequence or tp is None else tp.stream(y, s)

    @property
    def sequence(self) -> bool:
        """Sequence parallelism (`TensorParallel.sequence`): the blocks carry this process's rows only."""
        return self.tp is not None and self.tp.sequence

    def split_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This process's rows of a whole stream x before sequence-parallel blocks (x itself without)."""
        return self.tp.rows(x) if self.sequence else x

    def join_rows(self, x: torch.Tensor, s: int) -> torch.Tensor:
        """The whole stream [s, ...] after sequence-parallel blocks (all-gathered; x itself without)."""
        return self.tp.stream(x, s) if self.sequence else x

    def column(self, x: torch.Tensor, prefixes: list[str], s: int) -> tuple[torch.Tensor, ...]:
        """The column-split matrices `prefixes` (with their biases) of one input x, a stream of s rows:
        Megatron's f before them under tensor parallelism; under sequence parallelism x is this
        process's rows, all-gathered over the rank first (`TensorParallel.gather_linear`)."""
        if self.sequence:
            return self.tp.gather_linear(x, s, [(self.w(p + ".weight"), self.params.get(p + ".bias")) for p in prefixes])
        x = x if self.tp is None else self.tp.enter(x)
        return tuple(self.linear(p, x) for p in prefixes)

    def local_heads(self, heads: int) -> int:
        """Heads of an attention this process computes: all, or its 1 / t under tensor parallelism."""
        return heads if self.tp is None else heads // self.tp.size

    def split_rms_norm(self, prefix: str, x: torch.Tensor, eps: float) -> torch.Tensor:
        """`rms_norm` over a vector whose heads are split over the rank (InternViT's QK-norm over all
        heads): the sum of squares summed over the rank first; `rms_norm` without tensor parallelism."""
        if self.tp is None:
            return self.rms_norm(prefix, x, eps)
        xf = x.float()
        total = self.tp.sum(torch.sum(xf * xf, dim=-1, keepdim=True))
        y = xf * torch.rsqrt(total / (x.shape[-1] * self.tp.size) + eps)
        return self.w(prefix + ".weight") * y.to(x.dtype)

    def row_linear(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """`linear` of a matrix split by row under tensor parallelism: partial products summed over
        the rank (reduce-scattered to this process's rows under sequence parallelism), the bias (whole
        on every process) added once after the sum."""
        if self.tp is None:
            return self.linear(prefix, x)
        y = F.linear(x, self.w(prefix + ".weight"))
        y = self.tp.scatter(y) if self.tp.sequence else self.tp.exit(y)
        bias = self.params.get(prefix + ".bias")
        return y if bias is None else y + bias

    def vision_attention(self, prefix: str, x: torch.Tensor, heads: int, angles: torch.Tensor | None,
                         ids: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        """The Qwen vision attention: fused `qkv` (head-minor [3, H, D]), 2-D rotary, `proj` (under
        tensor parallelism this process's heads: qkv by column, proj by row; under sequence
        parallelism x is this process's rows, ids and angles whole)."""
        s, d = ids.shape[0], x.shape[1]
        local = self.local_heads(heads)
        qkv = self.column(x, [prefix + ".qkv"], s)[0].reshape(s, 3, local, d // heads)
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
        if angles is not None:
            q, k = rope(q, angles), rope(k, angles)
        return self.row_linear(prefix + ".proj", attn(q, k, v, ids).reshape(s, local * (d // heads)))

    # ------------------------------------------------------------------ the stream
    def hidden(self, llm_ints: torch.Tensor, vision_ints: torch.Tensor, vision_floats: torch.Tensor,
               attn: AttnFn = dense_attn, router_only: bool = False) -> torch.Tensor | None:
        """Final LLM hidden states [S, d] of one shard of the two streams (`FamilyLayout.inputs`).
        `router_only`: stop after the last sparse layer and return None (`router_pass`)."""
        cfg = self.config
        col = {k: llm_ints[:, i].long() for i, k in enumerate(LLM_INTS)}
        vi = {k: vision_ints[:, i].long() for i, k in enumerate(VISION_INTS)}
        width = patch_dim(cfg)
        table = self.w("model.language_model.embed_tokens.weight")
        x = F.embedding(col["token_ids"], table) if self.tp is None else self.tp.embed(table, col["token_ids"])
        vision = col["vision"][:, None] > 0
        encoder = models.spec(cfg.family).engine_module("torch").encode      # the family's encoder
        feats, deep = encoder(self, vi, vision_floats[:, :width], vision_floats[:, width:], attn)
        x = torch.where(vision, feats.to(x.dtype), x)
        ids = torch.stack([col["segment"], col["position"], torch.zeros_like(col["segment"])], dim=1)
        angles = rope_angles(cfg.text.rope, llm_ints[:, len(LLM_INTS):])
        s = x.shape[0]
        x = self.split_rows(x)                   # sequence parallelism: the blocks run on this process's rows
        spec = getattr(cfg.text, "moe", None)
        self.router_stats = []                   # the sparse blocks' routing of this forward pass
        last = max((i for i, sp in enumerate(spec.sparse) if sp), default=-1) if spec is not None else -1
        for i in range(last + 1 if router_only else cfg.text.num_layers):
            x = self.decoder_block(f"model.language_model.layers.{i}", x, angles, ids, attn,
                                   spec is not None and spec.sparse[i])
            if i < len(deep):                    # DeepStack: added on the vision tokens after layer i
                x = x + self.split_rows(torch.where(vision, deep[i].to(x.dtype), torch.zeros_like(deep[i], dtype=x.dtype)))
        if router_only:
            return None
        return self.rms_norm("model.language_model.norm", self.join_rows(x, s), cfg.text.shape.eps)

    def router_pass(self, llm_ints: torch.Tensor, llm_floats: torch.Tensor, vision_ints: torch.Tensor,
                    vision_floats: torch.Tensor, attn: AttnFn = dense_attn) -> list:
        """The `npu_backend.moe.RouterStats` of each sparse block of one shard (the arguments of
        `loss_sum`), from a forward pass without gradients that runs the vision encoder and the LLM
        layers up to the last sparse one (no later layer, no LM head): the first phase of a step
        with the load-balancing loss (`npu_backend.executor`)."""
        if getattr(self.config.text, "moe", None) is None:
            raise ValueError(f"{self.config.family}: the model has no mixture-of-experts layer (no router to run)")
        with torch.no_grad():
            self.hidden(llm_ints, vision_ints, vision_floats, attn, router_only=True)
        return self.router_stats

    def head(self) -> torch.Tensor:
        """The LM head weight [V, d] (the token embedding when tied)."""
        return self.w("model.language_model.embed_tokens.weight" if self.config.tied else LM_HEAD)

    def loss_sum(self, llm_ints: torch.Tensor, llm_floats: torch.Tensor, vision_ints: torch.Tensor,
                 vision_floats: torch.Tensor, attn: AttnFn = dense_attn) -> torch.Tensor:
        """Sum over the shard's tokens of weight * cross entropy (fp32), as `packed_loss_sum`."""
        h = self.hidden(llm_ints, vision_ints, vision_floats, attn)
        target = llm_ints[:, LLM_INTS.index("target")].long()
        if self.tp is not None:   # vocab-parallel LM head and cross entropy
            return self.tp.token_loss_sum((self.tp.enter(h) @ self.head().T).float(), target, llm_floats[:, 0])
        logits = (h @ self.head().T).float()
        picked = torch.gather(logits, -1, target[:, None])[:, 0]
        return torch.sum((torch.logsumexp(logits, dim=-1) - picked) * llm_floats[:, 0])

    def logits(self, sample: Sample) -> torch.Tensor:
        """float32[L, vocab] logits of one sample (`hf.sample_from_inputs`), dense on this process."""
        layout = pack_family_group([sample], 1, self.config)
        llm_ints, _, vision_ints, vision_floats = stream_tensors(layout)
        with torch.no_grad():
            h = self.hidden(llm_ints, vision_ints, vision_floats)
            return (h[torch.from_numpy(layout.real_index)] @ self.head().T).float()


def stream_tensors(layout: FamilyLayout, shard: int = 0, device: torch.device | None = None
                   ) -> tuple[torch.Tensor, ...]:
    """Shard `shard` of a group's four stream arrays as torch tensors (LLM rows S/d each, vision
    rows S/d * unit each: the shards `pack_family_group` lays out for the JAX engine)."""
    n = layout.bucket // layout.degree
    per_slot = layout.vision_ints.shape[0] // layout.bucket           # `packed.unit`
    rows = (n, n, n * per_slot, n * per_slot)
    return tuple(torch.from_numpy(np.ascontiguousarray(a[shard * r:(shard + 1) * r])).to(device or "cpu")
                 for a, r in zip(layout.inputs(), rows))


def rope_angles(spec: RopeSpec, positions: torch.Tensor) -> torch.Tensor:
    """angles[S, D/2] (fp32) = positions[S, axis[j]] * inv_freq[j] (`RopeSpec.angles`)."""
    axis = torch.as_tensor(spec.axis, dtype=torch.long, device=positions.device)
    inv = torch.as_tensor(np.asarray(spec.inv_freq, np.float32), device=positions.device)
    return positions.float()[:, axis] * inv[None, :]


def rope(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of x[S, H, D] by angles[S, D/2] (cos/sin in fp32)."""
    cos = torch.cat([torch.cos(angles)] * 2, dim=-1)[:, None, :]
    sin = torch.cat([torch.sin(angles)] * 2, dim=-1)[:, None, :]
    xf, half = x.float(), x.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos + rotated * sin).to(x.dtype)


def segment_ids(segments: torch.Tensor) -> torch.Tensor:
    """Encoder ids [N, 3]: bidirectional inside a segment (> 0), dead rows (0) attend nowhere."""
    return torch.stack([segments, torch.zeros_like(segments), segments], dim=1)


# ---------------------------------------------------------------------------------------- loading
def load_family(path: str, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
                ) -> TorchFamilyModel:
    """The model of a directory written by transformers' `save_pretrained` (config.json and
    model.safetensors or its shards): read memory-mapped, tensor by tensor, renamed from older
    layouts as `dhp_jax.model.hf.load_pretrained` does, converted to `dtype`. `path` may be a Hub id
    in the local Hugging Face cache, as there."""
    path = checkpoint_dir(path)
    config = parse_config(read_config_json(path), where=os.path.join(path, "config.json"))
    renames = family(config.family).renames
    weights = {}
    named = ((rename(name, renames), array) for name, array in safetensors_io.read_checkpoint(path))
    for name, array in moe.fused_experts(named, config, path):   # experts as transformers holds them
        if config.tied and name == LM_HEAD:
            continue
        if name in weights:
            raise ValueError(f"{path}: checkpoint weight {name!r} appears twice")
        weights[name] = torch.from_numpy(np.array(array, np.float32)).to(device=device or "cpu", dtype=dtype)
    return TorchFamilyModel(config, weights)


def save_family(model: TorchFamilyModel, out_dir: str, max_shard_bytes: int = 5 * 2**30) -> None:
    """Write config.json and model.safetensors (sharded above `max_shard_bytes`) of `model`, as
    `dhp_jax.model.hf.save_pretrained` does (`dhp_jax.model.hf.checkpoint.saved_weights`: the same
    names, shapes and values; the names transformers' `save_pretrained` writes, a mixture of experts'
    experts in its family's published layout): transformers' `from_pretrained` and `load_family`
    load it."""
    weights = saved_weights({k: p.detach().cpu().numpy() for k, p in model.params.items()},
                            hf_module(model.config.family), model.config.text.moe is not None)
    write_pretrained(out_dir, model.config.raw, weights, max_shard_bytes)

"""A decoder-only language model of the Llama family (Llama 2/3, Mistral, Qwen2).

Pre-norm RMSNorm, rotary position embeddings (``models/rope.py``, Llama 3.1's
frequency scaling optional), grouped-query attention (``num_kv_heads`` key/value heads
shared by ``num_heads`` query heads), a SwiGLU MLP, no biases but optional ones on the
query, key and value projections (Qwen2), tied or separate input and output tables.

The model knows nothing of meshes: parameters carry logical axis names from {"vocab",
"embed", "heads", "kv_heads", "kv", "mlp", "layers"} and activations are constrained
with {"batch", "length", "embed", "heads", "kv_heads", "kv", "mlp", "vocab"}. (The
flash kernel alone runs per device, split as those names are: ``_flash``.) Rows may
pack several documents: ``segment_ids`` (1, 2, ...; 0 = padding) keep attention inside
each, and ``positions`` restart at 0 in each. With ``decode=True`` each attention keeps
a key/value cache (``models/kv_cache.py``) for generation (``models/generate.py``).

Weights are laid out as Hugging Face's checkpoints of these models are, up to
reshapes and transposes (``trainer/hf/names.py`` maps them): the query/key/value
and output projections ``[heads, head_dim, embed]`` (embed minor, like the
Transformer's: their gradients then reduce-scatter on TPU), the MLP ``[embed, mlp]``
and ``[mlp, embed]``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from models import layer_stack, rope
from models.kv_cache import cached_block
from models.layers import Embedding, RMSNorm, attention, named

Array = jax.Array
# The residual stream's features have their own logical name (MaxText's
# activation_embed): a run may split them over the model axis where the weights'
# embed dims stay whole (configs/maxtext.py, as MaxText's tensor-parallel runs did).
_EMBED_ACT = ("batch", "length", "activation_embed")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Hyperparameters of the decoder (defaults: Llama 3.2 1B's, but the vocabulary).

    Attributes:
      vocab_size: token ids.
      num_layers: decoder layers.
      emb_dim: the residual stream's width (``hidden_size``).
      num_heads: query heads.
      num_kv_heads: key/value heads, a divisor of ``num_heads`` (1: multi-query;
        ``num_heads``: multi-head).
      head_dim: channels per head.
      mlp_dim: the SwiGLU MLP's inner width (``intermediate_size``).
      rope_theta: RoPE's base.
      rope_scaling: Llama 3.1's frequency scaling, or None.
      rms_norm_eps: the norms' epsilon.
      qkv_bias: biases on the query, key and value projections (Qwen2).
      sliding_window: a token attends to the ``sliding_window`` tokens up to itself
        only (Mistral 7B v0.1's 4096); 0 = to all before it.
      mlp_activation: ``"swiglu"`` (gated: Llama's), or ``"relu"`` (one matrix in,
        one out: the PaLM-like model MaxText measured its MFU tables on).
      parallel_block: attention and MLP both read one norm of the layer's input and
        are added to it together (GPT-J, PaLM; MaxText's measured model); else one
        after the other, each with its own norm (Llama).
      tie_embeddings: the output (logits) table is the input table.
      attention: ``"dot"`` (XLA: scores [batch, heads, length, length] in memory) or
        ``"flash"``: the Pallas TPU flash-attention kernel of JAX
        (``jax.experimental.pallas.ops.tpu``), blocks of 512, which never holds the
        scores (MaxText's ``attention='flash'``; TPU only, and not when decoding).
      logits_dtype: the output projection's product: float32 (the logits never
        rounded), or ``dtype``'s, cast to float32 after (MaxText's default,
        ``logits_dot_in_fp32: false``): half the bytes of ``[rows, length, vocab]``,
        the largest activation of a step (1.46 GiB a chip of f32 logits at 6 rows of
        2,048 over 32,000 ids), at the cost of rounding them.
      max_len: the longest sequence the model takes (decoding caches this many).
      init_std: standard deviation of every initial weight (Llama's 0.02).
      dtype: activations and matmuls; param_dtype: the weights.
      remat: what each layer keeps for its backward pass (``models/remat.py``).
      scan_layers: the layers as one ``nn.scan``, parameters ``[layers, ...]``.
      scan_unroll: layers per iteration of that scan.
      decode: key/value caches for generation.
    """

    vocab_size: int
    num_layers: int = 16
    emb_dim: int = 2048
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 64
    mlp_dim: int = 8192
    rope_theta: float = 500_000.0
    rope_scaling: rope.Llama3Scaling | None = None
    rms_norm_eps: float = 1e-5
    qkv_bias: bool = False
    sliding_window: int = 0
    mlp_activation: str = "swiglu"
    parallel_block: bool = False
    tie_embeddings: bool = True
    attention: str = "dot"
    logits_dtype: Any = jnp.float32
    max_len: int = 8192
    init_std: float = 0.02
    dtype: Any = jnp.bfloat16
    param_dtype: Any = jnp.float32
    remat: str = "none"
    scan_layers: bool = True
    scan_unroll: int = 1
    decode: bool = False

    def __post_init__(self):
        # Checked where the config is read: a wrong size or policy would otherwise
        # surface as a shape or key error deep inside the first trace.
        for name in ("vocab_size", "num_layers", "emb_dim", "num_heads", "head_dim", "mlp_dim"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be a positive integer")
        if self.max_len < 1:
            raise ValueError(f"max_len={self.max_len} must be a positive integer")
        if self.remat not in layer_stack.REMAT_POLICIES:
            raise ValueError(
                f"remat={self.remat!r} is not one of {', '.join(layer_stack.REMAT_POLICIES)}"
            )
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads={self.num_kv_heads} must divide num_heads={self.num_heads} "
                "(each key/value head serves num_heads / num_kv_heads query heads)"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.mlp_activation not in ("swiglu", "relu"):
            raise ValueError(f"mlp_activation={self.mlp_activation!r}: swiglu or relu")
        if self.attention not in ("dot", "flash"):
            raise ValueError(f"attention={self.attention!r}: dot or flash")
        if self.attention == "flash" and self.sliding_window:
            raise ValueError("attention='flash' has no sliding window: use attention='dot'")


def causal_mask(segment_ids: Array, window: int = 0) -> Array:
    """bool [batch, 1, 1, length, length]: a token sees the tokens before it (and
    itself) of its own document, the last ``window`` of them (0: all); padding
    (segment 0) sees nothing."""
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    length = segment_ids.shape[1]
    distance = jnp.arange(length)[:, None] - jnp.arange(length)[None, :]
    earlier = (distance >= 0) & ((distance < window) if window else True)
    return (same & earlier & (segment_ids > 0)[:, :, None])[:, None, None]


class Attention(nn.Module):
    """Grouped-query self-attention with rotary positions; a cache when decoding."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, x: Array, positions: Array, mask: Array | None) -> Array:
        cfg = self.config
        kv_heads, group = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads
        init = nn.initializers.normal(stddev=cfg.init_std)

        def project(name: str, heads: int, heads_axis: str) -> Array:
            w = self.param(
                name,
                named(init, heads_axis, "kv", "embed"),
                (heads, cfg.head_dim, cfg.emb_dim),
                cfg.param_dtype,
            )
            y = jnp.einsum("ble,hde->blhd", x, w.astype(cfg.dtype))
            if cfg.qkv_bias:
                b = self.param(
                    f"{name}_bias",
                    named(nn.initializers.zeros, heads_axis, "kv"),
                    (heads, cfg.head_dim),
                    cfg.param_dtype,
                )
                y = y + b.astype(cfg.dtype)
            return nn.with_logical_constraint(y, ("batch", "length", heads_axis, "kv"))

        # [batch, length, heads, head_dim] and [batch, length, kv_heads, head_dim], in dtype
        q = project("query", cfg.num_heads, "heads")
        k = project("key", kv_heads, "kv_heads")
        v = project("value", kv_heads, "kv_heads")
        inv_freq = rope.inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        q, k = rope.apply(q, positions, inv_freq), rope.apply(k, positions, inv_freq)
        if cfg.decode:
            k, v, mask = cached_block(self, k, v, mask)
        if cfg.attention == "flash" and not cfg.decode:
            out = _flash(q, k, v, mask)  # ``mask``: the segment ids, here
        else:
            # Query head h = kv_head * group + g: the order Hugging Face's repeat_kv gives.
            q = q.reshape(q.shape[:2] + (kv_heads, group, cfg.head_dim))
            out = attention(q, k, v, mask, cfg.dtype)
            out = out.reshape(out.shape[:2] + (cfg.num_heads, cfg.head_dim))
        w_out = self.param(
            "out",
            named(init, "heads", "kv", "embed"),
            (cfg.num_heads, cfg.head_dim, cfg.emb_dim),
            cfg.param_dtype,
        )
        return jnp.einsum("blhd,hde->ble", out, w_out.astype(cfg.dtype))


def _flash(q: Array, k: Array, v: Array, segment_ids: Array) -> Array:
    """Causal attention within segments by the Pallas TPU flash kernel: q
    [batch, length, heads, head_dim], k and v [batch, length, kv_heads, head_dim].

    A Pallas kernel runs on one device's arrays: XLA's partitioner cannot split it
    ("Mosaic kernels cannot be automatically partitioned"). So where the surrounding
    mesh leaves axes to the partitioner (the model axis of tensor parallelism inside
    ``per_layer``'s replicas, every axis under ``wus``'s ``vmap``), the kernel runs in
    a ``shard_map`` over them, each device on its share of the rows and heads as the
    logical rules split them ("batch", "heads"). Key and value heads are repeated to
    the query heads first, so a query head meets its own key head however the two
    are split.
    """
    group = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)  # head h: kv h // group
    mesh = jax.sharding.get_abstract_mesh()
    auto = frozenset(mesh.auto_axes)
    if not auto:  # no mesh, or every axis already manual: this is one device's share
        return _flash_kernel(q, k, v, segment_ids)

    def spec(*logical: str) -> PartitionSpec:
        # Only the axes left to the partitioner (manual ones are split already), and
        # none that does not divide its dim (``init``'s one row): that dim is whole on
        # every device, which is correct, only not split.
        def kept(axes, size):
            axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
            axes = tuple(a for a in axes if a in auto)
            if size % math.prod(mesh.shape[a] for a in axes):
                return None
            return axes[0] if len(axes) == 1 else (axes or None)

        # The leading dims of q: [batch, length, heads, head_dim] or [batch, length].
        names, sizes = nn.logical_to_mesh_axes(logical), q.shape[: len(logical)]
        return PartitionSpec(*(kept(a, n) for a, n in zip(names, sizes, strict=True)))

    heads = spec("batch", "length", "heads", "kv")
    if heads[1] is not None or heads[3] is not None:
        # Each device would attend within its own stretch of the sequence only.
        raise ValueError(
            f"attention='flash' cannot split the sequence or head_dim (mesh axes {heads}): "
            "use attention='dot'"
        )
    return jax.shard_map(
        _flash_kernel,
        in_specs=(heads, heads, heads, spec("batch", "length")),
        out_specs=heads,
        axis_names=auto,
        # The kernel's outputs vary as its inputs do; its custom_vjp is not checked.
        check_vma=False,
    )(q, k, v, segment_ids)


def _flash_kernel(q: Array, k: Array, v: Array, segment_ids: Array) -> Array:
    """:func:`_flash` on one device's arrays, with as many key/value heads as query heads."""
    from jax.experimental.pallas.ops.tpu import flash_attention as fa  # noqa: PLC0415  (TPU)

    block = min(512, q.shape[1])
    # The dQ kernel's key/value blocks at 128, not 512: the kernel broadcasts its
    # per-row inputs (``di``, float32 [batch, heads, length]) to [..., block_k_dq]
    # before the call, so 512 holds 4x the bytes. At MaxText's 16B on v5e-256 (6 rows
    # of 2,048) that broadcast was 1.5 GiB of the 10.3 GiB live at the step's peak;
    # at 128 the program needs 1.18 GiB less HBM a chip (docs/aot.md). 128 is also
    # the kernel's own default (``BlockSizes.get_default``).
    dq_block = min(128, q.shape[1])
    sizes = fa.BlockSizes(
        block_q=block,
        block_k_major=block,
        block_k=block,
        block_b=1,
        block_q_major_dkv=block,
        block_k_major_dkv=block,
        block_k_dkv=block,
        block_q_dkv=block,
        block_k_major_dq=dq_block,
        block_k_dq=dq_block,
        block_q_dq=block,
    )
    heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731
    out = fa.flash_attention(
        heads_first(q),
        heads_first(k),
        heads_first(v),
        segment_ids=fa.SegmentIds(segment_ids, segment_ids),
        causal=True,
        sm_scale=q.shape[-1] ** -0.5,
        block_sizes=sizes,
    )
    return heads_first(out)


class Mlp(nn.Module):
    """SwiGLU, down(silu(gate(x)) * up(x)); or down(relu(up(x)))."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        cfg = self.config
        init = nn.initializers.normal(stddev=cfg.init_std)

        def weight(name: str, shape: tuple[int, int], names: tuple[str, str]) -> Array:
            return self.param(name, named(init, *names), shape, cfg.param_dtype).astype(cfg.dtype)

        inner = (cfg.emb_dim, cfg.mlp_dim)
        up = x @ weight("up", inner, ("embed", "mlp"))
        if cfg.mlp_activation == "swiglu":
            h = nn.silu(x @ weight("gate", inner, ("embed", "mlp"))) * up
        else:
            h = nn.relu(up)
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        return h @ weight("down", (cfg.mlp_dim, cfg.emb_dim), ("mlp", "embed"))


class DecoderLayer(nn.Module):
    """x + attention(norm(x)), then + mlp(norm(x)); a scan body under ``scan_layers``
    (it returns ``(x, None)``)."""

    config: DecoderConfig

    @nn.compact
    def __call__(self, x: Array, positions: Array, mask: Array | None):
        cfg = self.config
        norm = {"dtype": cfg.dtype, "param_dtype": cfg.param_dtype, "epsilon": cfg.rms_norm_eps}
        normed = RMSNorm(**norm, name="attention_norm")(x)
        h = Attention(cfg, name="attention")(normed, positions, mask)
        if cfg.parallel_block:
            h = h + Mlp(cfg, name="mlp")(normed)
            x = nn.with_logical_constraint(x + h, _EMBED_ACT)
        else:
            x = nn.with_logical_constraint(x + h, _EMBED_ACT)
            h = Mlp(cfg, name="mlp")(RMSNorm(**norm, name="mlp_norm")(x))
            x = nn.with_logical_constraint(x + h, _EMBED_ACT)
        return (x, None) if cfg.scan_layers else x


# The input token table's module: a task's ``lookup_tables`` entry when it is untied.
TOKEN_TABLE = "token_embedding"


class Decoder(nn.Module):
    """The language model; see :class:`DecoderConfig`.

    Attributes:
      config: the model's hyperparameters.
      layer_weights: ``(stack name, transform)`` pairs: the weights the stack's layers
        compute with (:mod:`models.layer_stack`; empty: their parameters); and, for an
        untied input table, ``(TOKEN_TABLE, lookup)``: the table is handed in another
        form than whole (a shard) and ``lookup(table, ids) -> rows`` reads it.
    """

    config: DecoderConfig
    layer_weights: tuple[tuple[str, layer_stack.LayerWeights], ...] = ()

    def setup(self) -> None:
        cfg = self.config
        table = dict(
            num_embeddings=cfg.vocab_size,
            features=cfg.emb_dim,
            dtype=cfg.dtype,
            param_dtype=cfg.param_dtype,
            stddev=cfg.init_std,
        )
        lookup = layer_stack.transform_of(self.layer_weights, TOKEN_TABLE)
        if lookup is not None and cfg.tie_embeddings:
            raise ValueError("a tied token table also computes the logits: it is read whole")
        self.token_embedding = Embedding(**table, lookup=lookup)
        if not cfg.tie_embeddings:
            self.output_embedding = Embedding(**table)
        self.layers = layer_stack.layer_stack(
            DecoderLayer,
            (cfg,),
            name="layers",
            length=cfg.num_layers,
            scan=cfg.scan_layers,
            remat=cfg.remat,
            static_argnums=(),
            broadcast=2,
            layer_weights=self.layer_weights,
            unroll=cfg.scan_unroll,
        )
        self.final_norm = RMSNorm(cfg.dtype, cfg.param_dtype, cfg.rms_norm_eps)

    def __call__(
        self,
        ids: Array,
        *,
        positions: Array | None = None,
        segment_ids: Array | None = None,
        mask: Array | None = None,
    ) -> Array:
        """Float32 logits [batch, length, vocab] of the token after each position.

        Args:
          ids: int [batch, length] token ids.
          positions: int [batch, length] positions within each document (default
            0, 1, ...).
          segment_ids: int [batch, length] documents of a packed row (1, 2, ...; 0 =
            padding): attention stays inside each, causally. Default: one document.
          mask: bool [batch, 1, 1, length, keys] instead of the causal mask of the
            segments (decoding: which cache slots each new token sees, the caller's).
        """
        cfg = self.config
        if ids.shape[1] > cfg.max_len:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds max_len {cfg.max_len}")
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(ids.shape[1]), ids.shape)
        if mask is None and not cfg.decode:
            segments = jnp.ones_like(ids) if segment_ids is None else segment_ids
            # The flash kernel takes the segments and masks causally itself.
            flash = cfg.attention == "flash"
            mask = segments if flash else causal_mask(segments, cfg.sliding_window)
        x = nn.with_logical_constraint(self.token_embedding(ids), _EMBED_ACT)
        x = layer_stack.run(self.layers, x, positions, mask)
        x = self.final_norm(x)
        table = self.token_embedding if cfg.tie_embeddings else self.output_embedding
        logits = table.attend(x, cfg.logits_dtype)
        return nn.with_logical_constraint(logits, ("batch", "length", "vocab"))


def _mlp_matrices(cfg: DecoderConfig) -> int:
    return 3 if cfg.mlp_activation == "swiglu" else 2


def param_count(cfg: DecoderConfig) -> int:
    """Exact number of parameters, with V vocab, E embed, H heads, K kv heads, D head
    dim, M mlp and L layers: the tables V*E (twice if untied); per layer attention
    E*D*(2H + 2K) (+ D*(H + 2K) biases), MLP 3*E*M (SwiGLU; 2*E*M with ReLU), a
    norm E before each of the two (one for a parallel block); a final norm E."""
    v, e, d = cfg.vocab_size, cfg.emb_dim, cfg.head_dim
    h, k, m = cfg.num_heads, cfg.num_kv_heads, cfg.mlp_dim
    tables = v * e * (1 if cfg.tie_embeddings else 2)
    attention_params = e * d * (2 * h + 2 * k) + (d * (h + 2 * k) if cfg.qkv_bias else 0)
    norms = e if cfg.parallel_block else 2 * e
    layer = attention_params + _mlp_matrices(cfg) * e * m + norms
    return tables + cfg.num_layers * layer + e


def matmul_params(cfg: DecoderConfig) -> int:
    """The parameters a token multiplies by in a forward pass: every projection and
    the output table (the input table is a lookup, not a matmul; norms and biases
    are elementwise)."""
    e, d = cfg.emb_dim, cfg.head_dim
    layer = e * d * (2 * cfg.num_heads + 2 * cfg.num_kv_heads)
    layer += _mlp_matrices(cfg) * e * cfg.mlp_dim
    return cfg.num_layers * layer + cfg.vocab_size * e


def train_flops_per_token(cfg: DecoderConfig, length: int, *, causal_half: bool = True) -> float:
    """Model FLOPs of one training token (forward and backward: 3 x the forward's) in
    MaxText's convention: 6 x :func:`matmul_params` (every matmul 2 FLOPs a weight, the
    output table included, the input lookup not) plus attention's two matmuls,
    ``2 x 2 x length x heads x head_dim`` a layer forward, halved for causal attention
    (``causal_half``: only the scores at or before each token are needed), as MaxText
    counts them since its FLOP fix."""
    attention_forward = 4 * length * cfg.num_heads * cfg.head_dim * cfg.num_layers
    if causal_half:
        attention_forward /= 2
    return 6.0 * matmul_params(cfg) + 3.0 * attention_forward

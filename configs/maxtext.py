"""The models and runs of MaxText's published MFU tables, rebuilt with our decoder, to
compile with ``trainer.aot`` on the same TPU topology and hold our estimates against
measurements no one here made (``python scripts/published.py``; docs/aot.md).

What MaxText measured (AI-Hypercomputer/maxtext: ``MaxText/configs/v5e/README.md``
and ``16b.sh`` ... ``128b.sh``, Oct 2023; ``MaxText/configs/v5p/README.md`` and its
``32b.sh``, ``64b.sh``, Dec 2023, all at commit 76bd53b0) is its "default" decoder of
the time, not a Llama: one RMSNorm a layer feeding attention and the MLP side by side
(a parallel block), a ReLU MLP of one matrix in and one out, multi-head attention
with head_dim 256 (not emb / heads), a 32,768-id table tied to the output, 2,048
tokens a row. ``global_parameter_scale`` 16/32/64/128 scales base emb 2560, 8 heads,
mlp 8192, 16 layers (``pyconfig.get_individual_scales``). Runs: AdamW, bf16 matmuls
on f32 weights, FSDP over the whole slice (``ici_fsdp_parallelism=-1``), batch per
chip 6/4/2/1 with ``remat_policy=full`` on v5e-256 (128B: FSDP 16 x tensor 16), and
batch 8/4 with ``remat_policy=minimal`` (dots without batch dims kept) and tensor
parallelism 4 on v5p-128.

    python -m trainer.aot --config configs/maxtext.py:v5e-32b --topology v5e:16x16 \\
        --modes per_layer,wus

Variants: ``tiny`` (the architecture, small, learning on CPU), ``v5e-16b``,
``v5e-32b``, ``v5e-64b``, ``v5e-128b`` (one v5e-256 slice),
``v5p-32b``, ``v5p-64b`` (v5p-128: 64 chips), and ``slices=N`` (N slices, data
parallel over the data-center network, as MaxText's ``dcn_data_parallelism``: the
global batch is N times one slice's).

``today`` (with ``v5e-16b`` or ``v5e-32b``): the model MaxText 0.2.5's own
``configs/tpu/v5e/16b.sh`` and ``32b.sh`` build today, to compile beside MaxText's
``train_compile`` of them (docs/aot.md, "One compiler, two programs"): its base.yml's
Llama-2 block (RMSNorm, RoPE of base 10,000, SwiGLU, multi-head attention of head dim
128, an untied table of 32,000) scaled by ``global_parameter_scale`` 16 or 32 as its
``types.get_individual_scales`` does (16: d 4096, 64 heads, MLP 28,672, 32 layers,
15.8B parameters; 32: d 8192), the same batch, remat, flash attention and flags.
"""

import ml_collections

from configs import common, llama

VARIANTS = {
    "tiny": "their model's architecture at 2 layers, d 64, on the embedded tiny_text corpus",
    "v5e-16b": "MaxText's 16B (16.27B parameters) on a v5e-256 slice: 6 rows a chip",
    "v5e-32b": "MaxText's 32B (32.55B) on a v5e-256 slice: 4 rows a chip",
    "v5e-64b": "MaxText's 64B (64.76B) on a v5e-256 slice: 2 rows a chip",
    "v5e-128b": "MaxText's 128B (129.19B) on a v5e-256 slice, FSDP 16 x tensor 16: 1 row a chip",
    "v5p-32b": "MaxText's 32B on a v5p-128 slice (64 chips), tensor 4: 8 rows a chip",
    "v5p-64b": "MaxText's 64B on a v5p-128 slice (64 chips), tensor 4: 4 rows a chip",
    "today": "with v5e-16b or v5e-32b: the model MaxText 0.2.5's 16b.sh / 32b.sh build today",
}

# global_parameter_scale -> (layers, emb, mlp, heads): base 16/2560/8192/8 scaled as
# MaxText's pyconfig.get_individual_scales does.
SCALES = {
    16: (32, 5120, 32768, 32),
    32: (32, 10240, 32768, 32),
    64: (64, 10240, 32768, 32),
    128: (64, 10240, 65536, 64),
}
# global_parameter_scale -> (layers, emb, mlp, heads) of MaxText 0.2.5's base.yml (16
# layers, d 2048, MLP 7168, 16 heads of 128) scaled by its types.get_individual_scales.
SCALES_TODAY = {16: (32, 4096, 28672, 64), 32: (32, 8192, 28672, 64)}
# variant -> (scale, chips in a slice, rows a chip, remat, tensor parallelism, the
# MFU MaxText measured on one slice and, where published, on two).
RUNS = {
    "v5e-16b": (16, 256, 6, "full", 1, 0.6110, 0.5937),
    "v5e-32b": (32, 256, 4, "full", 1, 0.6686, 0.6481),
    "v5e-64b": (64, 256, 2, "full", 1, 0.5990, 0.5666),
    "v5e-128b": (128, 256, 1, "full", 16, 0.5606, 0.5582),
    "v5p-32b": (32, 64, 8, "dots_no_batch", 4, 0.7147, 0.6943),
    "v5p-64b": (64, 64, 4, "dots_no_batch", 4, 0.7031, 0.6726),
}
LENGTH = 2048
# The LIBTPU_INIT_ARGS of MaxText's scripts (v5e: 16b.sh ... 128b.sh; v5p: 32b.sh, 64b.sh
# at commit 76bd53b0), as compile options.
_FLAGS = (
    "xla_tpu_enable_data_parallel_all_reduce_opt=true "
    "xla_tpu_data_parallel_opt_different_sized_ops=true "
    "xla_tpu_enable_async_collective_fusion=true "
    "xla_tpu_enable_async_collective_fusion_multiple_steps=true "
    "xla_tpu_overlap_compute_collective_tc=true "
    "xla_enable_async_all_gather=true"
)
FLAGS = {
    "v5e": _FLAGS + " xla_tpu_enable_async_collective_fusion_fuse_all_gather=true",
    "v5p": _FLAGS
    + " xla_tpu_megacore_fusion_allow_ags=false xla_enable_async_collective_permute=true"
    " xla_tpu_enable_ag_backward_pipelining=true",
}


def measured_mfu(variant: str, slices: int = 1) -> float:
    """The MFU MaxText published for ``variant`` on ``slices`` slices (1 or 2)."""
    return RUNS[variant][5 if slices == 1 else 6]


def get_config(variant: str = "v5e-32b") -> ml_collections.ConfigDict:
    """Returns the run config; ``variant`` is the text after ``:`` on the CLI."""
    parts, options = common.variant_options(variant, VARIANTS, ("slices",))
    if "tiny" in parts:
        if len(parts) > 1 or options:
            raise ValueError(f"tiny takes no other variant (got {variant!r})")
        return _tiny()
    runs = [p for p in parts if p in RUNS] or ["v5e-32b"]  # v5e-32b: the default
    if len(runs) != 1:
        raise ValueError(f"name one of {', '.join(RUNS)} (got {variant!r})")
    scale, chips, rows, remat, tensor, _, _ = RUNS[runs[0]]
    slices = int(options.get("slices", 1))
    today = "today" in parts
    if today and runs[0] not in ("v5e-16b", "v5e-32b"):
        raise ValueError(f"today: MaxText 0.2.5's v5e-16b or v5e-32b (got {variant!r})")
    layers, emb, mlp, heads = (SCALES_TODAY if today else SCALES)[scale]
    vocab = 32_000 if today else 32_768
    config = llama.get_config("synthetic")
    config.model.update(
        vocab_size=vocab,
        num_layers=layers,
        emb_dim=emb,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=128 if today else 256,
        mlp_dim=mlp,
        mlp_activation="swiglu" if today else "relu",
        parallel_block=not today,
        tie_embeddings=not today,
        rope_scaling_factor=0.0,
        rms_norm_eps=1e-5 if today else 1e-6,
        max_len=LENGTH,
        remat=remat,
        # MaxText's attention='flash'; where tensor parallelism splits the heads (128B,
        # v5p) each device runs the kernel on its share of them.
        attention="flash",
    )
    if today:
        config.model.rope_theta = 10_000.0  # base.yml's rope_max_timescale
        # base.yml's logits_dot_in_fp32: false (the output projection in bf16, its
        # result cast to float32: cast_logits_to_fp32: true).
        config.model.logits_dtype = "bfloat16"
    config.data.update(max_length=LENGTH, vocab_size=vocab)
    config.global_batch_size = rows * chips * slices
    config.mesh.axes = ml_collections.ConfigDict({"data": -1, "model": tensor})
    config.mesh.dcn_axes = ml_collections.ConfigDict({"data": slices, "model": 1})
    if tensor > 1:
        # MaxText's rules split the residual stream's features over its tensor axis
        # (activation_embed -> tensor): each chip keeps 1/tensor of every layer's
        # input for the backward pass (the 128B's: 40 GiB a chip whole).
        config.mesh.rules = tuple(
            (name, "model" if name == "activation_embed" else axis)
            for name, axis in config.mesh.rules
        )
    # MaxText's AdamW (base.yml of the time): b2 0.95, eps 1e-8, weight decay 0.1, clip 1.
    config.optimizer.update(eps=1e-8)
    config.optimizer.update_sharding = "per_layer"
    # Gradients reduced in bf16, as MaxText's are assumed to be (JAX's gradient of a
    # bf16 matmul is bf16; not read from a MaxText program).
    config.optimizer.reduce_dtype = "bfloat16"
    config.compiler_options = FLAGS[runs[0].split("-")[0]]
    config.num_train_steps = 30  # as its scripts ran
    config.steps_per_loop = 2
    config.log_every_steps = 2
    config.eval_every_steps = 0
    config.checkpoint_every_steps = 0
    return config


def _tiny() -> ml_collections.ConfigDict:
    """MaxText's model of the time (a parallel block, a ReLU MLP, multi-head attention,
    a tied table) at the size of configs/llama.py:tiny, learning on its corpus on CPU."""
    config = llama.get_config("tiny")
    config.model.update(
        num_kv_heads=config.model.num_heads,  # multi-head attention
        mlp_activation="relu",
        parallel_block=True,
        tie_embeddings=True,
        rms_norm_eps=1e-6,
    )
    return config

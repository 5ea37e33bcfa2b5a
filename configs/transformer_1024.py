"""Transformer (big) on WMT14 en-de: the 2048-core row of Xu et al. 2020, Table 1.

MLPerf v0.7 setup: encoder-decoder, 6+6 layers, d_model 1024, MLP 4096, 16 heads,
shared embeddings, global batch 2048 on 1024 TPU-v3 chips (2048 cores), Adam with
a linear warm-up then inverse-square-root decay, label smoothing 0.1, f32
parameters with bf16 compute, weight-update sharding over the data axis.

Run (needs the prepared dataset, see trainer/input/translation.py):

  python -m trainer --config configs/transformer_1024.py --workdir /tmp/wmt

A laptop-sized variant on the embedded synthetic translation task:

  python -m trainer --config configs/transformer_1024.py:tiny --workdir /tmp/demo \\
      --cpu_devices 8

Your own sentence pairs (TSV or JSONL files, trainer/input/text_pairs.py), here the
sample files shipped in examples/text_pairs/:

  python -m trainer --config configs/transformer_1024.py:pairs --workdir /tmp/pairs \
      --cpu_devices 8 [--config.data.train_files=/my/train*.tsv ...]

Variants, combinable with commas (``:base,synthetic``): ``tiny`` (embedded data,
~2 minutes on 2 CPU cores), ``pairs`` (the tiny model on files of sentence pairs),
``base`` (Transformer-base sizes), ``synthetic`` (random tokens, no dataset needed),
``update_heavy`` (one 16-token row per replica on 8 devices, the regime where
weight-update sharding pays most). E.g.

  python -m trainer.bench --config configs/transformer_1024.py:base,synthetic,update_heavy \\
      --cpu_devices 8
"""

import os

import ml_collections

from configs import common

# The variants after ``:`` on the command line, combinable with commas.
VARIANTS = {
    "tiny": "a small Transformer on the embedded translation data (~2 min on 2 CPU cores)",
    "base": "Transformer-base sizes (d_model 512, 8 heads, MLP 2048)",
    "synthetic": "random tokens: no dataset needed (for bench and aot)",
    "update_heavy": "one 16-token row per replica on 8 devices: where WUS pays most",
    "pairs": "the tiny model on files of sentence pairs: examples/text_pairs/ (or yours)",
}
# The sample sentence pairs of the ``pairs`` variant (scripts/make_sample_pairs.py).
SAMPLE_PAIRS = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "examples", "text_pairs"
)


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    """Returns the run config; ``variant`` is the text after ``:`` on the CLI."""
    config = common.base_config()
    config.global_batch_size = 2048
    config.num_train_steps = 20_000
    config.steps_per_loop = 100
    config.log_every_steps = 100
    config.eval_every_steps = 2_000
    config.checkpoint_every_steps = 2_000
    config.label_smoothing = 0.1  # of the training loss's one-hot targets
    config.max_decode_length = 256  # BLEU's decoding: tokens per translation at most
    # BLEU decodes with beam search (Vaswani et al.: beam 4, length penalty alpha 0.6,
    # the GNMT penalty ((5 + length) / 6) ** alpha); 1 = greedy.
    config.eval_beam_size = 4
    config.length_penalty = 0.6  # beam search's alpha

    config.model = ml_collections.ConfigDict(
        dict(
            name="transformer",  # the model family (models/)
            vocab_size=32_000,  # token ids; the data's vocabulary must fit
            share_embeddings=True,  # one table for input, output and logits
            emb_dim=1024,  # d_model
            num_heads=16,  # attention heads
            num_encoder_layers=6,  # encoder layers
            num_decoder_layers=6,  # decoder layers
            qkv_dim=1024,  # query/key/value width over all heads
            mlp_dim=4096,  # the feed-forward layer's width
            max_len=256,  # positions of the sinusoidal embedding
            dropout_rate=0.1,  # on embeddings and residual branches
            attention_dropout_rate=0.1,  # on the attention weights
            dtype="bfloat16",  # activations and matmuls
            param_dtype="float32",  # the master weights
            # Activation rematerialisation per layer: none | full | dots | dots_no_batch.
            remat="none",
            # One nn.scan over each stack of 6 layers, parameters stored [6, ...]: a
            # step then gathers and reduces each kind of weight once, not once per layer
            # (17 reduce-scatters and 19 all-gathers instead of 97 and 97 on v3:32x32;
            # TPU compiler estimate 22.2 vs 25.8 ms a step, compiled in 11 s vs 35 s).
            scan_layers=True,
            # Layers per iteration of those scans (>= 6: unrolled, as without scan).
            scan_unroll=1,
        )
    )
    config.data = common.data_config(
        "wmt14_translate/de-en",
        # Tokenizing a host's rows takes a few ms a step: a few workers keep up.
        worker_count=4,
        source_lang="en",  # the translated-from language's key (TFDS or JSONL)
        target_lang="de",  # the translated-to language's key
        # A SentencePiece model to use; None = train one on the training pairs.
        vocab_path=ml_collections.FieldReference(None, field_type=str),
        vocab_size=32_000,  # pieces of the vocabulary trained when vocab_path is None
        max_length=256,  # tokens per example (longer ones are cut)
        pack=True,  # several training pairs per row of max_length tokens
        eval_split="test",  # the TFDS split evaluated on
        num_eval_examples=-1,  # eval examples (the first N); -1 = all
        # With name="text_pairs": your own pairs, globs of .tsv / .jsonl files (local
        # or gs://), see trainer/input/text_pairs.py.
        train_files=(),
        eval_files=(),  # with name="text_pairs": the pairs evaluated on
    )
    # Peak ~ 2 * d_model^-0.5 * warmup^-0.5 of the usual "noam" rule.
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 0.002
    config.optimizer.schedule = "rsqrt"
    config.optimizer.warmup_steps = 1000
    config.optimizer.b1 = 0.9
    config.optimizer.b2 = 0.98
    config.optimizer.eps = 1e-9
    # Partial update sharding (MLPerf multipod paper): on the 2048-core v3 pod, groups
    # of 64 replicas get true reduce-scatters and all-gathers where whole-pod groups
    # are lowered to all-reduces; TPU compiler estimate 25.6 ms vs 30.4 ms a step
    # (python -m trainer.aot --config configs/transformer_1024.py:synthetic).
    config.optimizer.shard_group_size = 64

    config.mesh.rules = (
        ("batch", "data"),
        ("vocab", "model"),
        ("embed", None),
        ("mlp", "model"),
        ("heads", "model"),
        ("kv", None),
        ("length", None),
        ("layers", None),  # the stacked layers of model.scan_layers: never split
    )

    parts = common.variant_parts(variant, VARIANTS)
    if "tiny" in parts or "pairs" in parts:
        config.global_batch_size = 64
        config.num_train_steps = 600
        config.steps_per_loop = 20
        config.log_every_steps = 100
        config.eval_every_steps = 300
        config.checkpoint_every_steps = 300
        config.max_decode_length = 48
        config.eval_beam_size = 1  # greedy: evaluations stay a few seconds on 2 CPU cores
        config.model.update(
            vocab_size=384,
            emb_dim=64,
            num_heads=4,
            num_encoder_layers=2,
            num_decoder_layers=2,
            qkv_dim=64,
            mlp_dim=256,
            max_len=64,
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
        )
        config.data.update(
            name="tiny_translation",
            vocab_size=384,
            max_length=48,
            eval_split="validation",
            num_eval_examples=256,
            worker_count=0,
        )
        config.optimizer.learning_rate = 0.003
        config.optimizer.warmup_steps = 100
        config.optimizer.min_shard_bytes = 4096
    if "pairs" in parts:
        config.data.update(
            name="text_pairs",
            source_lang="en",
            target_lang="toy",
            train_files=(os.path.normpath(os.path.join(SAMPLE_PAIRS, "train.tsv")),),
            eval_files=(os.path.normpath(os.path.join(SAMPLE_PAIRS, "eval.jsonl")),),
            num_eval_examples=-1,  # all 300
        )
    if "base" in parts:
        config.model.update(emb_dim=512, num_heads=8, qkv_dim=512, mlp_dim=2048)
    if "synthetic" in parts:
        config.data.name = "synthetic"
        config.data.worker_count = 0  # Random ids cost nothing to make.
    if "update_heavy" in parts:
        # The paper's 1024-chip regime on 8 devices: one short row per replica, so
        # the weight update, not the forward pass, dominates the step.
        config.global_batch_size = 8
        config.data.max_length = 16
        config.steps_per_loop = 4
    return config

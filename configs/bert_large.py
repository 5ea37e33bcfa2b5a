"""BERT-large pretrained with LAMB as a masked language model: the multipod paper's BERT.

MLPerf v0.7's BERT (Kumar et al. 2020, "Exploring the limits of concurrency in ML
training on Google TPUs", section 4.1): BERT-large (24 layers, hidden 1024, 16 heads,
feed-forward 4096, 30,522 uncased WordPiece ids: 335,174,458 parameters with the
masked-LM head, as Hugging Face's BertForMaskedLM counts them), rows of 512 tokens
with at most 76 masked, LAMB (You et al. 2019), and data parallelism only, weight
updates sharded: on 4,096 TPU-v3 chips, 2 rows a chip (their Figure 8), a global batch
of 8,192. Your documents, as for the decoder (trainer/input/language/):

  python -m trainer --config configs/bert_large.py --workdir gs://bucket/bert \\
      --config.data.train_files=gs://bucket/wiki/*.jsonl.gz \\
      --config.data.eval_files=gs://bucket/wiki/eval.jsonl

A small BERT that learns on the embedded corpus, on CPU:

  python -m trainer --config configs/bert_large.py:tiny --workdir /tmp/bert --cpu_devices 8

Variants: ``tiny`` (2 layers, d 64, the embedded tiny_text corpus, ~1 minute on 2 CPU
cores), ``synthetic`` (random tokens: no data, for trainer.bench and trainer.aot).
"""

import ml_collections

from configs import common, llama

VARIANTS = {
    "tiny": "a 2-layer BERT on the embedded tiny_text corpus (~1 min on 2 CPU cores)",
    "synthetic": "random tokens: no dataset needed (for bench and aot)",
}


def get_config(variant: str = "") -> ml_collections.ConfigDict:
    """Returns the run config; ``variant`` is the text after ``:`` on the CLI."""
    parts = common.variant_parts(variant, VARIANTS)
    config = common.base_config()
    config.global_batch_size = 8192  # 2 rows a chip on 4,096 TPU-v3 chips (the paper's run)
    config.num_train_steps = 1_000
    config.steps_per_loop = 50
    config.log_every_steps = 50
    config.eval_every_steps = 500
    config.checkpoint_every_steps = 500
    config.model = ml_collections.ConfigDict(
        dict(
            name="bert",  # the model family (models/bert.py)
            vocab_size=30_522,  # BERT's uncased WordPiece vocabulary
            num_layers=24,  # encoder layers
            emb_dim=1024,  # hidden size
            num_heads=16,  # attention heads (64 channels each)
            mlp_dim=4096,  # the feed-forward width
            max_len=512,  # the position table
            type_vocab_size=2,  # token types (every token is type 0: no next-sentence task)
            layer_norm_eps=1e-12,  # BERT's
            dropout_rate=0.1,  # on embeddings and sublayer outputs
            attention_dropout_rate=0.1,  # on the attention weights
            init_std=0.02,  # standard deviation of the initial weights
            dtype="bfloat16",  # activations and matmuls
            param_dtype="float32",  # the master weights
            # Activation rematerialisation per layer: none | full | dots | dots_no_batch.
            remat="none",
            scan_layers=True,  # one nn.scan over the layers, parameters [layers, ...]
            scan_unroll=1,  # layers per iteration of that scan
        )
    )
    config.data = llama.data_section(
        max_length=512,  # MLPerf's rows
        vocab_size=30_522,
        # BERT's masking: 15% of a row's tokens, at most 76 (MLPerf's max_predictions_per_seq),
        # 80% replaced by the mask, 10% by a random token, 10% left.
        masked=True,
        mask_rate=0.15,  # the share of a row's tokens masked
        max_predictions=76,  # masked tokens a row at most
    )
    # LAMB as MLPerf's BERT reference runs it (its reference convergence point at batch
    # 256: learning rate 3.5e-4, betas 0.9/0.999, eps 1e-6, weight decay 0.01, no
    # warm-up), the rate scaled by sqrt(8192 / 256) (LAMB's square-root rule, You et
    # al. 2019), decayed linearly to 0 (BERT's polynomial decay of power 1).
    config.optimizer.update(
        name="lamb",
        learning_rate=2e-3,
        schedule="polynomial",
        power=1.0,
        end_learning_rate=0.0,
        warmup_steps=0,
        b1=0.9,
        b2=0.999,
        eps=1e-6,
        weight_decay=0.01,
    )
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
    if "tiny" in parts:
        config.global_batch_size = 32
        config.num_train_steps = 300
        config.steps_per_loop = 20
        config.log_every_steps = 100
        config.eval_every_steps = 100
        config.checkpoint_every_steps = 300
        config.eval_at_start = True
        config.model.update(
            vocab_size=384,
            num_layers=2,
            emb_dim=64,
            num_heads=4,
            mlp_dim=256,
            max_len=64,
            dropout_rate=0.0,
            attention_dropout_rate=0.0,
        )
        config.data.update(
            name="tiny_text",
            vocab_size=384,
            max_length=64,
            max_predictions=10,
            num_eval_rows=128,
            worker_count=0,
        )
        config.optimizer.update(learning_rate=5e-3, warmup_steps=20)
        config.optimizer.min_shard_bytes = 4096
    if "synthetic" in parts:
        config.data.name = "synthetic"
        config.data.worker_count = 0  # Random ids cost nothing to make.
    return config

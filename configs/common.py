"""Keys every run config has, with their defaults.

Each ``configs/<name>.py`` starts from :func:`base_config`, builds its ``data``
section with :func:`data_config` and sets what its model needs, so the trainer
never guesses a default with ``config.get``.
"""

from collections.abc import Iterable

import ml_collections


def base_config() -> ml_collections.ConfigDict:
    """The common top-level keys and the mesh and optimizer sections."""
    config = ml_collections.ConfigDict()
    config.seed = 0  # initialisation, dropout and the input order derive from it
    config.global_batch_size = 256  # examples per optimizer step, over all devices
    config.num_train_steps = 1000  # optimizer steps of the whole run
    # > 0: passes over the training rows instead: num_train_steps is computed from the
    # data (rows an epoch x epochs / global_batch_size, rounded up) and said at start.
    config.num_train_epochs = 0.0
    # K training steps run inside one compiled call; Python only runs between loops,
    # so the *_every_steps below must be multiples of it.
    config.steps_per_loop = 10
    config.log_every_steps = 100  # a metrics row and console line every N steps; 0 = never
    config.eval_every_steps = 1000  # evaluate every N steps and at the end; 0 = never
    # Also evaluate the initial parameters, before the first step (a fresh run's row 0).
    config.eval_at_start = False
    # Outputs shown beside the eval metrics, in the log and TensorBoard: translations,
    # a decoder's continuations of held-out documents, BERT's masked-token guesses.
    config.eval_samples = 3
    config.checkpoint_every_steps = 1000  # save every N steps and at the end; 0 = only at the end
    config.keep_checkpoints = 3  # checkpoints kept (>= 1; the newest complete one always)
    # Warn (once) when a step's loss exceeds this many times the lowest of the 1000 steps
    # before it: a diverging run may never reach NaN. 0 = never.
    config.loss_growth_warning = 10.0
    # Seconds after which a work directory's lock in an object store (gs://), not renewed,
    # is a dead run's and is taken over. One run at a time holds a work directory
    # (DIR/run.lock, trainer/workdir/lock.py); a local one needs no timeout (the OS
    # drops a dead run's lock).
    config.workdir_lock_timeout_s = 60.0
    # Peak FLOP/s of one device for MFU. 0 = from the device kind (trainer/parallel/hardware.py:
    # published bf16 peaks of TPU v2-v6e, A100/H100/H200); a CPU has none, so no MFU.
    config.peak_flops_per_device = 0.0
    # On CPU, measure this machine's f32 matmul peak at the run's start and report MFU
    # against it (labelled so: it moves with the machine's load).
    config.measure_cpu_peak = False
    # XLA and libtpu options for every compile of the training loop, by the trainer and
    # by trainer.aot alike: "name=value" pairs separated by spaces, e.g.
    # "xla_tpu_decompose_every_reduce_scatters_hlos=true" (merges a step's small
    # reduce-scatters into a few fused ones on TPU; README, "Collectives"). A name the
    # back end does not know fails the compile.
    config.compiler_options = ""
    # The dtype evaluation computes in (eval loss and accuracy, BLEU's decoding, HR@10):
    # float32 gives the same metrics on any device count and mesh; in bfloat16 the
    # per-device shapes change XLA's summation order inside each matmul, and the
    # roundings move the metrics by ~1e-5 relative (accuracy by ~2e-3 early in a run).
    # bfloat16 is faster on accelerators, if that difference does not matter.
    config.eval_dtype = "float32"
    # JAX's persistent compilation cache: a restarted run loads its compiled steps
    # instead of compiling them again. A path or URL (gs://...); None =
    # <workdir>/compilation_cache; "" = no cache.
    config.compilation_cache_dir = ml_collections.FieldReference(None, field_type=str)
    # Start a new run from these parameters: a directory written by trainer.export, or
    # another run's directory (its newest checkpoint). Any mesh and update-sharding mode;
    # ignored once this run has a checkpoint of its own. None = from the initialisers.
    config.init_from = ml_collections.FieldReference(None, field_type=str)
    # Parameters (paths like "decoder_layers_1/mlp/wo/kernel", fnmatch patterns such as
    # "*/mlp/*") that start from their initialisers even if init_from has them.
    config.init_from_skip = ()
    # (first step, count): trace steps first+1 .. first+count into <workdir>/profile for
    # TensorBoard's profile plugin. Both multiples of steps_per_loop; () = no trace.
    config.profile_steps = ()
    # Weights & Biases: also log there when a project is set (pip install -e '.[wandb]').
    config.wandb = ml_collections.ConfigDict(
        dict(
            project=ml_collections.FieldReference(None, field_type=str),  # None = no W&B
            entity=ml_collections.FieldReference(None, field_type=str),  # team or user
        )
    )

    config.mesh = ml_collections.ConfigDict()
    # Per-slice axis sizes; -1 = the devices the other axes leave.
    config.mesh.axes = ml_collections.ConfigDict({"data": -1, "model": 1})
    # How many slices each axis spans (multi-slice runs over DCN).
    config.mesh.dcn_axes = ml_collections.ConfigDict({"data": 1, "model": 1})
    # (logical axis, mesh axis or None) pairs: how the model's named axes are split.
    config.mesh.rules = (("batch", "data"),)
    # Use only the first N devices (0 = all), e.g. to try a smaller mesh on a laptop.
    config.mesh.num_devices = 0

    config.optimizer = ml_collections.ConfigDict()
    config.optimizer.name = "adam"  # sgd | momentum | adam | adamw | lamb | lars
    config.optimizer.learning_rate = 1e-3  # the peak, after warm-up
    config.optimizer.schedule = "constant"  # constant | rsqrt | cosine | polynomial
    config.optimizer.warmup_steps = 0  # linear warm-up from 0 to learning_rate
    config.optimizer.warmup_ratio = 0.0  # with warmup_steps 0: warm up this share of the steps
    config.optimizer.end_learning_rate = 0.0  # cosine and polynomial schedules: the rate at the end
    config.optimizer.power = 2.0  # polynomial schedule: the decay's exponent
    config.optimizer.b1 = 0.9  # adam, adamw, lamb: first-moment decay
    config.optimizer.b2 = 0.999  # adam, adamw, lamb: second-moment decay
    config.optimizer.eps = 1e-8  # adam, adamw, lamb: added to the denominator
    config.optimizer.weight_decay = 0.0  # adamw, lamb, lars (decoupled)
    config.optimizer.momentum = 0.9  # momentum, lars: the momentum's decay
    config.optimizer.nesterov = False  # momentum, lars: Nesterov's variant
    config.optimizer.trust_coefficient = 0.001  # lars: the trust ratio's coefficient
    config.optimizer.clip_norm = 0.0  # 0 = no global-norm clipping
    # Optimizer state dtype of the param-shaped leaves ("" = the params' dtype).
    config.optimizer.state_dtype = ""
    # Split each step's batch into this many micro-batches whose gradients add up
    # (global_batch_size stays the batch of one optimizer step).
    config.optimizer.accumulate_steps = 1
    # Weight-update sharding (Xu et al. 2020): none | wus | fsdp (ZeRO-3) | auto. auto
    # compiles the candidates below for the run's TPU devices (or trainer.aot's
    # --topology) and picks the fastest estimate that fits HBM; off TPU it means wus.
    config.optimizer.update_sharding = "wus"
    # Weights every consumer rounds to bf16 anyway are all-gathered in this dtype.
    config.optimizer.gather_dtype = "bfloat16"
    config.optimizer.reduce_dtype = "float32"  # dtype gradients are reduced in
    # Shard the update within groups of this many data replicas (0, or more than the
    # data axis has = all of them).
    config.optimizer.shard_group_size = 0
    # Parameters with fewer bytes per device (after model sharding) stay replicated.
    config.optimizer.min_shard_bytes = 65536
    # Sharded parameters that each gather at most this many bytes per device share
    # all-gathers of up to this size (their shards concatenated, gathered once, cut
    # apart): fewer rings for many small tensors. 0 = one all-gather per parameter.
    # (Their reduce-scatters merge in the TPU compiler: compiler_options above.)
    config.optimizer.gather_bucket_bytes = 0
    # Layouts may pad a tensor by at most this fraction; else it stays replicated
    # (at 1/3 the padded reduce-scatter + bf16 gather move as much as an all-reduce).
    config.optimizer.max_shard_padding = 0.25
    # The candidates of update_sharding=auto (besides none), each a full compile: modes
    # (fsdp only where wus does not fit HBM, per_layer only where neither does; none,
    # wus and fsdp are not compiled where the weights they hold alone exceed the HBM),
    # shard_group_size values (empty = the
    # groupings on rings of the TPU torus: a row, two rows, a plane, ..., the whole
    # slice; trainer/parallel/torus.py) and min_shard_bytes values (empty = the one above).
    config.optimizer.auto = ml_collections.ConfigDict(
        dict(modes=("wus", "fsdp", "per_layer"), shard_group_sizes=(), min_shard_bytes=())
    )
    return config


def data_config(name: str, *, worker_count: int, **fields) -> ml_collections.ConfigDict:
    """A ``data`` section: the keys every input pipeline reads, then the dataset's own.

    The shared keys are those of trainer/input/options.py:DataOptions.

    Args:
      name: TFDS dataset name, or an embedded one (e.g. "tiny_translation").
      worker_count: grain worker processes making training batches; 0 = in the
        trainer's process.
      **fields: the keys of this dataset's pipeline (image_size, vocab_path, ...).
    """
    return ml_collections.ConfigDict(
        dict(
            name=name,  # the TFDS dataset, an embedded one, or text_pairs
            # Where the prepared TFDS datasets are; None = TFDS's default directory.
            data_dir=ml_collections.FieldReference(None, field_type=str),
            train_split="train",  # the TFDS split trained on
            worker_count=worker_count,  # grain worker processes; 0 = in the trainer
            worker_buffer_size=2,  # batches each worker prepares ahead
            **fields,
        )
    )


def variant_parts(variant: str, known: Iterable[str]) -> set[str]:
    """The comma-separated parts of ``variant`` (the CLI's ``:tiny,synthetic``).

    Raises:
      ValueError: naming the parts not in ``known`` and the ones that are.
    """
    parts, options = variant_options(variant, known, ())
    return parts


def variant_options(
    variant: str, known: Iterable[str], options: Iterable[str]
) -> tuple[set[str], dict[str, str]]:
    """The comma-separated parts of ``variant``, and its ``key=value`` parts for the
    keys ``options`` names (the CLI's ``:tiny,hf=/models/llama``).

    Raises:
      ValueError: naming the parts not in ``known`` (or keys not in ``options``).
    """
    parts = set(variant.split(",")) - {""}
    given = dict(p.split("=", 1) for p in parts if "=" in p)
    parts -= {p for p in parts if "=" in p}
    expected = ", ".join([*known, *(f"{o}=..." for o in options)])
    if unknown := sorted(parts - set(known)) + sorted(set(given) - set(options)):
        raise ValueError(f"unknown variant {unknown} (expected {expected})")
    return parts, given

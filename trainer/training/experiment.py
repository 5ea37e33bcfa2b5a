"""Everything a run is made of, built from the config, before any step runs.

:func:`build_model` goes mesh -> data and task -> the model's abstract parameters
and their shardings: all that evaluation and decoding need. :func:`build` adds the
update-sharding plan, the optimizer and the train state (abstract shapes ->
shardings -> a jitted init that creates the state already sharded), and compiles
nothing until asked (:func:`compile_loop`). The trainer, the benchmark, the
ahead-of-time analysis and checkpoint restore all start from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import stacking
from trainer import console
from trainer import tasks as tasks_lib
from trainer.errors import ConfigError, floating_dtype
from trainer.parallel import batches, precision, run_once
from trainer.parallel import mesh as mesh_lib
from trainer.parallel import plan as plan_lib
from trainer.parallel import rules as rules_lib
from trainer.parallel import transform as transform_lib
from trainer.training import layerwise, optimizers
from trainer.training import step as step_lib


@dataclasses.dataclass(frozen=True)
class Model:
    """A config's model on a mesh, without optimizer or train state.

    Attributes:
      config: the run config.
      mesh: device mesh.
      rules: resolved logical-axis rules.
      task: model, data, loss and evaluation.
      abstract_params: ShapeDtypeStructs of the parameters, logical shapes, each
        with its sharding over the model axes.
      abstract_model_state: the non-trained variables (BatchNorm statistics), replicated.
      num_params: number of model parameters.
      layer_stacks: a tree like the params: the stack of layers (the scanned
        module, e.g. ``layers``) each parameter belongs to, or "".
    """

    config: ml_collections.ConfigDict
    mesh: Mesh
    rules: rules_lib.Rules
    task: tasks_lib.Task
    abstract_params: Any
    abstract_model_state: Any
    num_params: int
    layer_stacks: Any = None


@dataclasses.dataclass(frozen=True)
class Experiment:
    """The pieces of a run: a record of what :func:`build` made.

    Attributes:
      model: the model on its mesh (:class:`Model`).
      plan: the update-sharding plan (per-parameter layouts and collectives).
      optimizer: the optax transformation of the train state (update sharding included).
      abstract_state: ShapeDtypeStructs of the train state in the plan's stored layout.
      state_shardings: NamedShardings of the train state.
      logical_state: ShapeDtypeStructs (with shardings) of the train state in its
        logical shapes: the portable form checkpoints hold.
      fns: the step and loop functions (not yet jitted).
      init: ``(loaded=None, stored=None) -> TrainState``, created sharded; ``loaded``
        maps parameter names (``"a/b/kernel"``, :func:`trainer.parallel.rules.param_name`)
        to logical arrays that replace their initial values, ``stored`` to arrays
        already in their stored layout and sharding (donated; their initialisers are
        never run). The optimizer state starts from the result.
      lower_init: the program ``init()`` runs (nothing loaded), lowered: for its cost.
      to_logical: jitted: a train state -> its logical form (``logical_state``'s shardings).
      params_to_logical: jitted: the params alone, sharded over model axes only.
      from_logical: a train state in logical form (a restored checkpoint) -> this
        run's stored layout and shardings.
    """

    model: Model
    plan: plan_lib.UpdateShardingPlan
    optimizer: optax.GradientTransformation
    abstract_state: step_lib.TrainState
    state_shardings: step_lib.TrainState
    logical_state: step_lib.TrainState
    fns: step_lib.StepFns
    init: Callable[..., step_lib.TrainState]
    lower_init: Callable[[], jax.stages.Lowered]
    to_logical: Callable[[step_lib.TrainState], step_lib.TrainState]
    params_to_logical: Callable[[Any], Any]
    from_logical: Callable[[step_lib.TrainState], step_lib.TrainState]

    @property
    def config(self) -> ml_collections.ConfigDict:
        return self.model.config

    @property
    def mesh(self) -> Mesh:
        return self.model.mesh

    @property
    def task(self) -> tasks_lib.Task:
        return self.model.task


def lower_loop(exp: Experiment, k: int) -> jax.stages.Lowered:
    """The K-step loop of ``exp`` for ``k`` steps, jitted with explicit shardings and
    the state donated, lowered: ``(state, k stacked batches) -> (state, metrics)``."""
    replicated = NamedSharding(exp.mesh, PartitionSpec())
    jitted = jax.jit(
        exp.fns.train_loop,
        in_shardings=(exp.state_shardings, batches.sharding(exp.mesh, stacked=True)),
        out_shardings=(exp.state_shardings, replicated),
        donate_argnums=0,
    )
    abstract_batches = batches.abstract(
        exp.mesh, exp.task.init_batch, exp.config.global_batch_size, k
    )
    with jax.set_mesh(exp.mesh):
        return jitted.lower(exp.abstract_state, abstract_batches)


def compiler_options(config: ml_collections.ConfigDict) -> dict[str, bool | int | str]:
    """``config.compiler_options`` ("a=true b=4") as the compile call takes them.

    Raises:
      ConfigError: a pair without ``=``.
    """
    options: dict[str, bool | int | str] = {}
    for pair in config.compiler_options.split():
        name, equals, value = pair.partition("=")
        if not equals or not name:
            raise ConfigError(f"compiler_options: expected name=value pairs, got {pair!r}")
        lowered = value.lower()
        if lowered in ("true", "false"):
            options[name] = lowered == "true"
        else:
            options[name] = int(value) if value.lstrip("-").isdigit() else value
    return options


def compile_lowered(lowered: jax.stages.Lowered, config, **extra) -> jax.stages.Compiled:
    """``lowered.compile()`` with ``config.compiler_options`` (and ``extra`` ones).

    Raises:
      ConfigError: the back end does not know an option.
    """
    options = {**compiler_options(config), **extra}
    try:
        return lowered.compile(compiler_options=options or None)
    except jax.errors.JaxRuntimeError as e:
        if "No such compile option" not in str(e):
            raise
        raise ConfigError(f"compiler_options: {' '.join(str(e).split())}") from None


def compile_loop(exp: Experiment, k: int) -> jax.stages.Compiled:
    """:func:`lower_loop`, compiled with the config's ``compiler_options``."""
    return compile_lowered(lower_loop(exp, k), exp.config)


def _check_batch(config: ml_collections.ConfigDict, mesh: Mesh) -> None:
    batch, dp = config.global_batch_size, mesh_lib.data_parallel_size(mesh)
    micro = config.optimizer.accumulate_steps
    procs = jax.process_count()
    if micro < 1:
        raise ConfigError(f"optimizer.accumulate_steps must be >= 1, got {micro}")
    if batch % (dp * micro):
        raise ConfigError(
            f"global_batch_size={batch} is not divisible by the {dp} data-parallel replicas "
            f"of mesh {dict(mesh.shape)}"
            + (f" times accumulate_steps={micro}" if micro > 1 else "")
        )
    if batch % procs:
        raise ConfigError(f"global_batch_size={batch} is not divisible by {procs} processes")


def _dtype(section: ml_collections.ConfigDict, key: str) -> jnp.dtype:
    return floating_dtype(section[key], f"optimizer.{key}")


def _replica_loss(task: tasks_lib.Task) -> Callable:
    """``(params, model_state, rows) -> loss`` of the replicas' rows (``[replicas,
    *batch]``), as the train step computes it (inside the vmap over replicas,
    which models may reduce over: grouped BatchNorm needs the real count)."""

    def loss(params, model_state, rows):
        def one(rows):
            variables = {"params": params, **model_state}
            return task.loss_fn(variables, rows, jax.random.PRNGKey(0), True)[0]

        return jax.vmap(one, axis_name=tasks_lib.REPLICAS)(rows)

    return loss


def build_model(
    config: ml_collections.ConfigDict,
    *,
    devices: Sequence[jax.Device] | None = None,
    with_data: bool = True,
) -> Model:
    """Builds the mesh, the task and the model's abstract parameters.

    Args:
      config: the run config.
      devices: devices to build the mesh on (default ``jax.devices()``), e.g.
        those of a TPU topology this host only compiles for (:mod:`trainer.aot`).
      with_data: False opens no dataset: the task has no input pipeline.
    """
    # ---------------------------------------------------------------- mesh
    devices = list(jax.devices() if devices is None else devices)
    if not 0 <= config.mesh.num_devices <= len(devices):
        raise ConfigError(
            f"mesh.num_devices={config.mesh.num_devices} but there are {len(devices)} devices "
            f"(0 = all of them)"
        )
    mesh = mesh_lib.make_mesh(
        config.mesh.axes.to_dict(),
        config.mesh.dcn_axes.to_dict(),
        shard_group_size=config.optimizer.shard_group_size,
        devices=devices[: config.mesh.num_devices] if config.mesh.num_devices else devices,
    )
    rules = rules_lib.resolve_rules(config.mesh.rules, mesh)
    _check_batch(config, mesh)

    # ------------------------------------------------------- data and task
    task = tasks_lib.make_task(
        config,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        with_data=with_data,
    )

    # -------------------------------------------------- the model, abstract
    init_rng = jax.random.split(jax.random.PRNGKey(config.seed))[0]
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        boxed = jax.eval_shape(task.init_fn, init_rng, task.init_batch)
    specs = rules_lib.param_specs(boxed["params"], rules)
    params = jax.tree.map(
        lambda p, spec: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(mesh, spec)),
        nn.unbox(boxed["params"]),
        specs,
    )
    replicated = NamedSharding(mesh, PartitionSpec())
    model_state = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
        {k: v for k, v in nn.unbox(boxed).items() if k != "params"},
    )
    return Model(
        config=config,
        mesh=mesh,
        rules=rules,
        task=task,
        abstract_params=params,
        abstract_model_state=model_state,
        num_params=sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params)),
        layer_stacks=_layer_stacks(boxed["params"]),
    )


def _layer_stacks(boxed_params):
    """Each parameter's stack of layers: its top module's name where its first logical
    axis is the scan's ``layers`` (models name it so), else ""."""

    def stack(path, box):
        names = getattr(box, "names", ()) or ()
        return str(path[0].key) if names and names[0] == "layers" else ""

    return jax.tree_util.tree_map_with_path(
        stack, boxed_params, is_leaf=lambda x: isinstance(x, nn.Partitioned)
    )


def make_plan(model: Model, mode: str | None = None) -> plan_lib.UpdateShardingPlan:
    """The update-sharding plan of ``model`` under its config (``mode`` instead of
    ``optimizer.update_sharding`` if given): each parameter's layout, and which may
    be gathered in ``gather_dtype`` (:mod:`trainer.parallel.precision`)."""
    config, mesh, rules, task = model.config, model.mesh, model.rules, model.task
    opt_cfg = config.optimizer
    params = model.abstract_params
    specs = jax.tree.map(lambda p: p.sharding.spec, params)
    gather_dtype = _dtype(opt_cfg, "gather_dtype")
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules_lib.without_data_axes(rules, mesh)):
        replicas = mesh_lib.data_parallel_size(mesh)
        rows = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct((replicas, *x.shape), x.dtype), task.init_batch
        )
        unsharded = jax.tree.map(lambda p: jax.ShapeDtypeStruct(p.shape, p.dtype), params)
        flags = precision.params_precision(
            _replica_loss(task),
            unsharded,
            model.abstract_model_state,
            rows,
            low_dtype=gather_dtype,
        )
    return plan_lib.make_plan(
        params,
        specs,
        mesh,
        mode=mode or opt_cfg.update_sharding,
        min_shard_bytes=opt_cfg.min_shard_bytes,
        max_shard_padding=opt_cfg.max_shard_padding,
        low_precision=flags.low,
        kept_low=flags.kept,
        gather_dtype=gather_dtype,
        reduce_dtype=_dtype(opt_cfg, "reduce_dtype"),
        gather_bucket_bytes=opt_cfg.gather_bucket_bytes,
        stacks=model.layer_stacks,
    )


def _replaced(params, values, cast: bool):
    """``params`` with the leaves ``values`` names (``{"a/b/kernel": array}``)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: (
            (values[name].astype(x.dtype) if cast else values[name])
            if (name := rules_lib.param_name(path)) in values
            else x
        ),
        params,
    )


def build(
    config: ml_collections.ConfigDict,
    *,
    devices: Sequence[jax.Device] | None = None,
    with_data: bool = True,
    optimizer: optax.GradientTransformation | None = None,
) -> Experiment:
    """Builds the model, plan, optimizer and the (abstract) sharded train state.

    Args:
      config: the run config.
      devices: devices to build the mesh on (default ``jax.devices()``), e.g.
        those of a TPU topology this host only compiles for (:mod:`trainer.aot`).
      with_data: False opens no dataset: the task has no input pipeline.
      optimizer: an optax transformation to use instead of the one the config
        names (it is wrapped for update sharding the same way); the config's
        schedule still gives the logged learning rate.
    """
    model = build_model(config, devices=devices, with_data=with_data)
    mesh, rules, task = model.mesh, model.rules, model.task
    _steps_of_epochs(config, task)
    opt_cfg = config.optimizer
    replicated = NamedSharding(mesh, PartitionSpec())

    # ------------------------------------------------------ plan, optimizer
    plan = make_plan(model)
    tx = _sharded_optimizer(model, plan, optimizer)
    schedule = optimizers.make_schedule(opt_cfg, config.num_train_steps)

    # ------------------------------------------- the train state, abstract
    init_rng, state_rng = jax.random.split(jax.random.PRNGKey(config.seed))

    def init_state(rng_init, rng_state, loaded=None, stored=None):
        # Unboxed without Flax's constraint to the logical spec (replicated over data):
        # plan.spread places them instead, so that each device draws its share only.
        variables = stacking.unbox_unconstrained(task.init_fn(rng_init, task.init_batch))
        params = plan.spread(variables.pop("params"))
        if loaded:  # init_from: {"a/b/kernel": logical array} replaces the initial value
            params = _replaced(params, loaded, cast=True)
        params = plan.to_stored(params)
        if stored:  # the same, already in the stored layout (the initialisers left unrun)
            params = _replaced(params, stored, cast=False)
        return step_lib.TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            model_state=variables,
            rng=rng_state,
        )

    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        abstract_state = jax.eval_shape(init_state, init_rng, state_rng)
    state_shardings = step_lib.TrainState(
        step=replicated,
        params=plan.stored_shardings(),
        opt_state=plan.state_shardings(tx, abstract_state.opt_state),
        model_state=jax.tree.map(lambda _: replicated, abstract_state.model_state),
        rng=replicated,
    )
    logical_shapes = jax.eval_shape(
        lambda state: plan.train_state_to_logical(tx, state), abstract_state
    )
    logical_shardings = plan.logical_train_state_shardings(tx, logical_shapes, state_shardings)
    logical_state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
        logical_shapes,
        logical_shardings,
    )

    # ``stored`` is donated: those parameters become the state's, not copies of them.
    # Run once: on CPU at LLVM level 1, a faster compile (trainer/parallel/run_once.py).
    once = run_once.options(mesh.devices.flat)
    init_jit = jax.jit(
        init_state, out_shardings=state_shardings, donate_argnums=(3,), compiler_options=once
    )

    def init(
        loaded: dict[str, jax.Array] | None = None, stored: dict[str, jax.Array] | None = None
    ):
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return init_jit(init_rng, state_rng, loaded, stored)

    def lower_init() -> jax.stages.Lowered:
        with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
            return init_jit.lower(init_rng, state_rng)

    # -------------------------------- the stored <-> logical conversions
    to_logical = jax.jit(
        lambda state: plan.train_state_to_logical(tx, state), out_shardings=logical_shardings
    )
    params_to_logical = jax.jit(plan.to_logical, out_shardings=logical_shardings.params)

    from_logical = _from_logical(plan, tx, abstract_state, state_shardings)

    return Experiment(
        model=model,
        plan=plan,
        optimizer=tx,
        abstract_state=abstract_state,
        state_shardings=state_shardings,
        logical_state=logical_state,
        fns=step_lib.make_step_fns(
            task, plan, tx, schedule, rules, state_shardings, opt_cfg.accumulate_steps
        ),
        init=init,
        lower_init=lower_init,
        to_logical=to_logical,
        params_to_logical=params_to_logical,
        from_logical=from_logical,
    )


def _steps_of_epochs(config: ml_collections.ConfigDict, task: tasks_lib.Task) -> None:
    """Sets ``num_train_steps`` from ``num_train_epochs`` (> 0) and the data's rows an
    epoch (rounded up to whole loops of ``steps_per_loop``), and says so (process 0).

    Raises:
      ConfigError: the family does not count its rows an epoch.
    """
    epochs = config.num_train_epochs
    if epochs <= 0 or task.train_data is None:
        return
    if task.rows_per_epoch <= 0:
        raise ConfigError(
            f"num_train_epochs={epochs}: {config.model.name} runs do not count their rows an "
            "epoch; give num_train_steps instead"
        )
    steps = max(1, math.ceil(epochs * task.rows_per_epoch / config.global_batch_size))
    # Whole compiled loops: a shorter last one would be a compile of its own.
    steps = math.ceil(steps / config.steps_per_loop) * config.steps_per_loop
    config.num_train_steps = steps
    if jax.process_index() == 0:
        console.say(
            f"num_train_epochs={epochs:g}: {steps:,} steps of {config.global_batch_size} rows "
            f"({task.rows_per_epoch:,} rows an epoch; rounded up to whole loops of "
            f"steps_per_loop={config.steps_per_loop})"
        )


def _sharded_optimizer(
    model: Model,
    plan: plan_lib.UpdateShardingPlan,
    optimizer: optax.GradientTransformation | None,
) -> optax.GradientTransformation:
    """The config's optimizer (or ``optimizer``) wrapped for update sharding, once
    checked to compute on the stored layout what it computes on the logical one."""
    config, opt_cfg = model.config, model.config.optimizer

    def inner_for(layouts):
        # The optimizer is told the form it is handed each parameter in: its role and
        # per-layer norms do not depend on the layout (trainer/training/layerwise.py).
        views = layerwise.views(layouts, plan.stacks)
        return optimizers.make_optimizer(opt_cfg, views, config.num_train_steps)[0]

    # Refuses an optimizer that computes something else on a merged or padded tensor
    # (two optimizer steps on this host's CPU, once per experiment).
    dtypes = jax.tree.map(lambda p: p.dtype, model.abstract_params)
    transform_lib.check_layout_agnostic(optimizer or inner_for, plan, dtypes)
    return transform_lib.weight_update_sharding(
        optimizer or inner_for(plan.layouts),
        plan,
        state_dtype=_dtype(opt_cfg, "state_dtype") if opt_cfg.state_dtype else None,
    )


def _from_logical(plan, tx, abstract_state, state_shardings) -> Callable:
    """``from_logical(state)``: a train state in logical form (a restored checkpoint)
    -> the run's stored layout and shardings."""

    def from_logical(state: step_lib.TrainState) -> step_lib.TrainState:
        # The leaves the layout keeps as they are give their buffers to the result
        # (donated: a restore does not hold two copies of the state); the others are
        # reshaped or padded into new ones (XLA could not reuse theirs, and JAX
        # would warn about each).
        leaves, treedef = jax.tree.flatten(state)
        stored = [x.shape for x in jax.tree.leaves(abstract_state)]
        kept = [i for i, (x, s) in enumerate(zip(leaves, stored, strict=True)) if x.shape == s]
        reshaped = [i for i in range(len(leaves)) if i not in set(kept)]

        def convert(kept_leaves, reshaped_leaves):
            merged = [None] * len(leaves)
            for i, x in zip(kept + reshaped, [*kept_leaves, *reshaped_leaves], strict=True):
                merged[i] = x
            return plan.train_state_to_stored(tx, jax.tree.unflatten(treedef, merged))

        with jax.set_mesh(plan.mesh):
            return jax.jit(convert, out_shardings=state_shardings, donate_argnums=0)(
                [leaves[i] for i in kept], [leaves[i] for i in reshaped]
            )

    return from_logical

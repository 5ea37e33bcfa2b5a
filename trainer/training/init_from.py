"""``init_from``: start a new run from the parameters of an export or another run.

The source is read in logical shapes straight into this run's shardings, so any
mesh and any ``update_sharding`` mode can start from any source: a directory
written by ``python -m trainer.export`` (a plain Orbax tree of the params, any
dtype), or a run directory (the parameters of its newest checkpoint; its
optimizer state is not read). Every parameter of this model must be in the
source with the same shape, unless ``init_from_skip`` names it (an fnmatch
pattern such as ``"*/mlp/wo/*"``): those, e.g. a new output head, start from
their initialisers. The optimizer state starts fresh, from the loaded weights,
at step 0. Non-trained variables (BatchNorm statistics) start fresh too.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable

import jax
from etils import epath
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from models import stacking
from trainer import checkpoint as checkpoint_lib
from trainer.checkpoint import tree as tree_lib
from trainer.errors import ConfigError
from trainer.hf import checkpoint as hf_checkpoint
from trainer.training import experiment as experiment_lib
from trainer.training import step as step_lib
from trainer.workdir import storage


def _flat(tree) -> dict:
    """``{"a/b/kernel": leaf}`` of a nested dict of parameters."""
    return traverse_util.flatten_dict(tree, sep="/")


def _open(source: str):
    """``(description, saved params metadata, read(target) -> params)`` of a source."""
    if checkpoint_lib.has_checkpoints(source):
        checkpoints = checkpoint_lib.CheckpointReader(source)
        step = checkpoints.resolve_step()
        saved = checkpoints.state_metadata(step)["params"]

        def read(target):
            return checkpoints.restore_state_parts(step, {"params": target})["params"]

        return f"checkpoint {step} of {source}", saved, read
    try:
        saved = tree_lib.tree_metadata(source)
    except (FileNotFoundError, ValueError, OSError) as e:
        raise ConfigError(
            f"init_from={source} is neither a run directory with checkpoints nor a "
            f"directory written by trainer.export ({type(e).__name__}: {e})"
        ) from None
    return (
        f"the export {source}",
        saved,
        lambda target: tree_lib.restore_tree(source, target),
    )


def _source_targets(sources: dict[str, stacking.Source], wanted: dict, have: dict) -> dict:
    """What to read from the source, as ``{source name: ShapeDtypeStruct}``: the
    source's shapes in the wanted dtype, each sharded as the wanted leaf it becomes
    (a layer of a stack: without the layers dim; a stack of layers: replicated on it)."""
    targets = {}
    for name, source in sources.items():
        sharding = wanted[name].sharding
        spec = tuple(sharding.spec) + (None,) * (len(wanted[name].shape) - len(sharding.spec))
        if source.stacked:
            spec = spec[1:]
        elif source.index is not None:
            spec = (None, *spec)
        for n in source.names:
            targets[n] = jax.ShapeDtypeStruct(
                tuple(have[n].shape),
                wanted[name].dtype,
                sharding=NamedSharding(sharding.mesh, PartitionSpec(*spec)),
            )
    return targets


def check_source(init_from: str | None, workdir: epath.Path) -> None:
    """Fails early on an ``init_from`` that names the run's own work directory.

    Raises:
      ConfigError: if it does.
    """
    if init_from and storage.path(init_from) == workdir:
        raise ConfigError(
            f"init_from={init_from} is this run's own work directory (a run resumes from "
            "its own checkpoints by itself): point init_from at another run's directory or "
            "at a trainer.export"
        )


def initial_state(
    exp: experiment_lib.Experiment, log: Callable[[str], None]
) -> step_lib.TrainState:
    """The state a new run starts from: ``exp.init()``, with the parameters of
    ``config.init_from`` where it is set.

    Raises:
      ConfigError: listing every parameter missing from the source or of another
        shape there (and not skipped), and skip patterns that match nothing.
    """
    config = exp.config
    if not config.init_from:
        return exp.init()
    if hf_checkpoint.is_model_directory(config.init_from):
        return _from_hugging_face(exp, log)
    what, saved, read = _open(config.init_from)
    wanted = _flat(exp.model.abstract_params)
    have = _flat(saved)
    patterns = tuple(config.init_from_skip)
    skipped = [n for n in wanted if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    unused = [p for p in patterns if not any(fnmatch.fnmatchcase(n, p) for n in wanted)]
    if unused:
        raise ConfigError(f"init_from_skip patterns {unused} match no parameter of this model")
    # Another layer layout (scanned stacks vs one module per layer) is converted.
    sources = stacking.match({n: leaf for n, leaf in wanted.items() if n not in skipped}, have)
    problems = []
    for name, leaf in wanted.items():
        if name in skipped or name in sources:
            continue
        if name not in have:
            problems.append(f"{name} {tuple(leaf.shape)} is missing")
        else:
            problems.append(f"{name} is {tuple(have[name].shape)} there, {tuple(leaf.shape)} here")
    if problems:
        raise ConfigError(
            f"init_from: {len(problems)} parameters do not fit {what}: {'; '.join(problems)} "
            f"(name them in init_from_skip to start them from their initialisers)"
        )
    targets = _source_targets(sources, wanted, have)
    loaded = stacking.assemble(sources, _flat(read(traverse_util.unflatten_dict(targets, sep="/"))))
    state = exp.init(loaded)
    values = sum(math.prod(wanted[n].shape) for n in loaded)
    used = {n for source in sources.values() for n in source.names}
    extra = sorted(set(have) - used)
    converted = sum(s.stacked or s.index is not None for s in sources.values())
    log(
        f"init_from: {len(loaded)} of {len(wanted)} parameters ({values:,} values) from {what}"
        + (f" ({converted} converted between layer stacks and layers)" if converted else "")
        + (f"; from their initialisers: {', '.join(skipped)}" if skipped else "")
        + (f"; not in this model: {', '.join(extra)}" if extra else "")
    )
    return state


def _from_hugging_face(
    exp: experiment_lib.Experiment, log: Callable[[str], None]
) -> step_lib.TrainState:
    """The initial state with the parameters of the Hugging Face model ``init_from``
    names, each placed straight into this run's stored sharding (trainer/hf/checkpoint.py),
    and the optimizer state started from them."""
    config = exp.config
    imported = hf_checkpoint.load(
        config.init_from,
        exp.plan,
        exp.model.abstract_params,
        config.model,
        skip=tuple(config.init_from_skip),
    )
    count, values = len(imported.params), imported.values
    state = exp.init(stored=imported.params)  # the skipped ones from their initialisers
    log(
        f"init_from: {count} of {len(_flat(state.params))} parameters ({values:,} values) "
        f"from the Hugging Face model {config.init_from} ({imported.tensors_read} tensors read)"
        + (f"; from their initialisers: {', '.join(imported.skipped)}" if imported.skipped else "")
    )
    return state

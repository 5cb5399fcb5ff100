"""The evaluation's mesh, and the checkpoint's params placed on it as training placed them.

All local devices form one slice. The run's own ici axes (ici_*_parallelism) are kept when they fit the
devices here; otherwise (a checkpoint trained on another machine) the devices form one fsdp axis. Params
are restored straight onto their shardings, which the run's logical_axis_rules give for each param's
logical names (trainer/parallel/rules.py), so no device ever holds the whole model unless the rules
replicate it. Batches split their rows over the batch axes the same rules give `activation_batch`.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import jax
from jax.sharding import Mesh, NamedSharding

log = logging.getLogger(__name__)


def eval_mesh(mesh_cfg, devices) -> Mesh:
    """One slice over `devices`: the run's ici axes where they fit, else fsdp over all of them."""
    from trainer.config import ConfigError
    from trainer.parallel.mesh import build_mesh

    one_slice = dataclasses.replace(mesh_cfg, num_slices=1)
    try:
        mesh = build_mesh(one_slice, [list(devices)])
    except ConfigError as e:
        log.info("the run's mesh does not fit %d devices here (%s): one fsdp axis instead", len(devices), e)
        fsdp = dataclasses.replace(
            one_slice, ici_data_parallelism=1, ici_fsdp_parallelism=-1, ici_tensor_parallelism=1,
            ici_expert_parallelism=1,
        )  # fmt: skip
        mesh = build_mesh(fsdp, [list(devices)])
    log.info("evaluation mesh %s", dict(mesh.shape))
    return mesh


def row_shards(mesh: Mesh, rules) -> int:
    """How many ways the rows of a batch are split (the mesh axes `activation_batch` maps to)."""
    from trainer.parallel.rules import logical_to_spec

    spec = logical_to_spec(("activation_batch",), (mesh.size,), mesh, rules)[0]
    axes = () if spec is None else (spec,) if isinstance(spec, str) else spec
    return math.prod(mesh.shape[a] for a in axes)


def rows_sharding(mesh: Mesh, rules, names: tuple, shape: tuple) -> NamedSharding:
    """The sharding of an array whose dims have logical `names` (rows: `activation_batch`)."""
    from trainer.parallel.rules import logical_to_spec

    return NamedSharding(mesh, logical_to_spec(names, shape, mesh, rules))


def load_params(ckpt, model_cfg, mesh: Mesh, rules):
    """The checkpoint's params restored directly onto their training shardings on `mesh`."""
    from trainer.checkpoint import load_parameters
    from trainer.model import abstract_params, param_logical_axes
    from trainer.parallel.rules import tree_shardings

    abstract = abstract_params(model_cfg)
    shardings = tree_shardings(param_logical_axes(model_cfg), abstract, mesh, rules)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    return load_parameters(ckpt, target)

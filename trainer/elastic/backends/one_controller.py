"""What the one-controller backends share: one process sees every device of the job.

Its devices are grouped into slices by `trainer.parallel.mesh.group_into_slices`; snapshots are pinned on
the devices' hosts, never through the controller (`trainer.elastic.pinned_snapshots`); every period may
be planned (`auto`) and the silent-data-corruption check may run (it moves each slice's rows to another
slice, which one controller does itself). The job must be one process.
"""

from __future__ import annotations

import jax

from trainer.config.errors import ConfigError
from trainer.elastic.backends.backend import Backend, BackendSpec
from trainer.elastic.pinned_snapshots import PinnedSnapshots
from trainer.elastic.snapshot import HostSnapshots
from trainer.parallel.mesh import group_into_slices


class OneController(Backend):
    """A backend whose job is one process (see the module docstring); `why` is the auto rule's reason
    for choosing it, for messages."""

    why = "one process"

    def __init__(self, spec: BackendSpec):
        super().__init__(spec)
        settings = spec.settings
        if settings.multi_process:
            raise ConfigError(
                f"{spec.asked(self.name, self.why)} runs one process, but this job has {settings.num_processes} "
                "(num_processes, $JAX_NUM_PROCESSES or $SLURM_NTASKS): set cluster=processes (or auto), or "
                "start one process"
            )

    def slices(self, events) -> list[list]:
        return group_into_slices(jax.devices(), self.spec.mesh.num_slices)

    def snapshots(self, events, store) -> HostSnapshots:
        return PinnedSnapshots(events, store=store)

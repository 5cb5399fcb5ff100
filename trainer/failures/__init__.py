"""Failure kinds: one module per kind, each declaring its schedule entries, injector, detector, outcome,
events, badput cause and planner term (`trainer.failures.kind.FailureKind`), registered in
`trainer.failures.registry`:

    slice_loss      a slice fails mid-step (scheduled, random, or requested by trainer.chaos)
    process_death   a process of several is lost, or fails on its own (oom, bug)
    storage         a checkpoint read or save fails transiently
    nonfinite       a step's loss or gradients are not finite
    spike           a step's loss and update spike
    corruption      a slice's devices compute wrong numbers, or its copy of the parameters changes
    hang            a step's dispatch blocks without raising
    slow_step       the host stalls after a step

`fault_schedule` is parsed once, at config validation, into a typed `trainer.failures.plan.FaultPlan`
that the config carries (its `faults`). `chaos_requests` is the protocol by which `trainer.chaos` asks a
live run to lose a slice (slice_loss's injector reads the requests).
"""

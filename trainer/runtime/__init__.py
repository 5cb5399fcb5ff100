"""The runtime core: what one process runs to train, below the CLIs and the composition root (`trainer.run`).

`layout` (the run's layout on a slice set, shared with `trainer.compile`), `state`, `step` and `optim`
(the train state and the pure step), `attempt` (build one attempt), `restore` (the one restore order),
`loop` (the step loop), `evaluate`, `nonfinite`, `preemption` (SIGTERM in every phase) and
`executable_cache` (compiled executables kept per process), `compile_ahead` (survivor sets' steps compiled
in the background, those the run can resize onto next first).
"""

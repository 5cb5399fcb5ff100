"""What runs on the devices, and how a run is laid out on a set of slices: pure, no threads, files or events.

`state` (the train state and its shardings), `step` (the train, eval and replica-checksum steps), `optim`
(AdamW and the learning-rate schedule), `layout` (a run's `TrainSpec`, its `SliceLayout` on a slice set and
the one `lower_step` / `compile_step`, shared by the trainer and `trainer.compile`), `executable_cache`
(compiled executables kept per process).
"""

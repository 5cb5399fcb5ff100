"""One attempt: the train loop over a fixed set of active slices, and the host policies it applies.

`builder` (`AttemptBuilder`: the cached layout, then fresh iterators, checkpointer and restored state),
`restore` (the one restore order), `compile_ahead` (survivor sets' steps compiled in the background),
`loop` (the step loop, returning an `outcome`), `evaluate` (held-out evaluation between steps), and the
policies the loop applies to each step's record: `nonfinite` (`nan_policy`), `loss_spikes`
(`loss_spike_threshold`), `sdc` (the silent-data-corruption check).
"""

"""The worker side: per-slot request state, the slot runner (input preparation, model, sampler) and, in
`persistent_batch/`, the runner for the persistent-batch protocol."""

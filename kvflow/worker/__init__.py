"""The worker side: per-slot request state, input preparation, and the model runner."""

"""Client-side benchmarks against running servers (`kvflow bench serve`)."""

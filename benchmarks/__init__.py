"""kvflow's benchmarks: scripts run as `python benchmarks/<name>.py`, importable as `benchmarks.<name>`."""

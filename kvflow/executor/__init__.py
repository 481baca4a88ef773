"""Executors run the worker(s): in-process today; multiprocess and Ray are registered here as they arrive."""

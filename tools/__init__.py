"""Developer tools (default-model training, GGUF conversion): scripts, importable as `tools.<name>`."""

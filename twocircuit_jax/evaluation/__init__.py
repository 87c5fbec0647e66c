"""Evaluation beyond the training task: the benchmark suite (`twocircuit eval --suite`)."""

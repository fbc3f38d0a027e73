"""Prefect tasks, one module per stage: validate inputs, derive the cache key, run the
stage (in process or as torchrun workers), log to MLflow, return an artifact record."""

"""Prefect flows: the pipelines users trigger from the UI, the CLI or a schedule."""

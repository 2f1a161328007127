"""Prefect flows composing the tasks."""

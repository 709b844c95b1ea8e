"""Thin entry points (FastAPI routes, Celery tasks, CLI commands) over `shared`."""

"""Backends: one module per backend, each exposing `BACKEND` (see oracle/backend.py)."""

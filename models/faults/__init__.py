"""The seeded-fault catalogue (catalogue.py): port bugs of the production model's mechanisms, a module
per mechanism beside models/layers/'s, each with the block a correct oracle must name."""

from models import moved

__getattr__ = moved.forward("models.faults")  # the names of the module this package was before 2026-12, for one release

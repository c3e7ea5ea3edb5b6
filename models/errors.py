"""The error every reader of a checkpoint raises (its own module, so that the readers of the release formats
and of the plain layout both raise it without importing one another)."""


class CheckpointError(ValueError):
    """The checkpoint cannot be used; the message says which file or tensor and why."""

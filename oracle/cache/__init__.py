"""The artifact cache: content-addressed entries built once (checkpoints, programs, references, noise),
kept within a size limit, written into place."""

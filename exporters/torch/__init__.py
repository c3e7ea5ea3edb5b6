"""The torch backends: `eager` (the production model itself), `hf` (HF transformers as the candidate: the
harness's own sanity check) and `cuda` (the production model compiled by torch.compile), over the
candidate they share (exporters/torch/candidate.py)."""

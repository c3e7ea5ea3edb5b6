"""How a candidate is judged: metrics, block and e2e rows, thresholds (thresholds.toml), HF's own error at
a precision (noise), routing replay, in-situ rows, quantized distributions, the weight check of a shipped
file, gates (goldens, known divergences, sampling), and the rule that leaves host facts out of every
comparison (portable)."""

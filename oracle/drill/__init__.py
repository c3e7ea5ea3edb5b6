"""The drill-down: the points inside a failing block, compared one by one with HF's, the first that
diverges named (docs/drill.md)."""

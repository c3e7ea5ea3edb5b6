"""Results and their renderings: `CheckResult` and its JSON form (result.py), the markdown PR comment, the
HTML report, the matrix summaries (JUnit, merge, diff), provenance, and the saved baselines."""

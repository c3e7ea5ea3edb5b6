"""What several backends share: a lowered program's identity besides its weights, the weight check of a
program's weights file (model.ptd, model.irpa), and programs brought with --pte / --vmfb checked
before a runtime of this process sees them."""

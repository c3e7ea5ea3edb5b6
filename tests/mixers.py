"""An HF module and the production module that mirrors it on the same random weights (the mixer tests:
tests/test_kda.py, tests/test_mamba.py, tests/test_lightning.py)."""

import torch


def randomised(module, std: float = 0.3):
    """`module` in eval mode with every parameter drawn N(0, std) from torch's generator as the caller seeded it
    (std 0.3: decays and gates far from their init, a state that reaches the decode)."""
    with torch.no_grad():
        for prm in module.parameters():
            prm.copy_(torch.randn_like(prm) * std)
    return module.eval()


def same_weights(ref, ours, state: set, skip: tuple = ()):
    """`ours` with `ref`'s weights (but those whose names end with `skip`: buffers HF derives); only `state`, the
    production module's own state buffers, is left unloaded. Returns `ours`."""
    missing = ours.load_state_dict({k: v for k, v in ref.state_dict().items() if not (skip and k.endswith(skip))},
                                   strict=False)
    assert not missing.unexpected_keys and set(missing.missing_keys) == set(state), missing
    return ours

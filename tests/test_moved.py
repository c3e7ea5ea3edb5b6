"""The import paths of before the reorganisation of 2026-12 still work for one release (models/moved.py):
a module that moved whole is the same module object under its old name, a split one's names are found
where they went, each with a DeprecationWarning naming the new path; old `module:attr` backend names
resolve; `python -m` of an old module path runs the new one."""

import importlib
import subprocess
import sys
import warnings

import pytest

from models.moved import MOVED
from tests.conftest import ROOT

# one name per old module that was split or became a package, and the module it lives in now
NAMES = {
    "exporters.eager": ("TorchCandidate", "exporters.torch.candidate"),
    "exporters.executorch": ("lower_cpu", "exporters.executorch.lower"),
    "exporters.iree": ("IreeCandidate", "exporters.iree.candidate"),
    "exporters.mlx": ("MLXBackend", "exporters.mlx.backend"),
    "exporters.mlx_faults": ("FAULTS", "exporters.mlx.faults"),
    "exporters.llamacpp": ("Converter", "exporters.llamacpp.converter"),
    "exporters.given": ("check_in_child", "oracle.source.given"),
    "models": ("hf_args", "models.mapping"),
    "models.layers": ("Transformer", "models.layers.transformer"),
    "models.faults": ("CATALOGUE", "models.faults.catalogue"),
    "models.checkpoint": ("tiny_checkpoint", "oracle.source.seeded"),
    "models.quantized": ("unstack_experts", "models.checkpoint"),
    "oracle.reference": ("load_portable", "oracle.reference.saved"),
    "oracle.selftest": ("render", "oracle.selftest.result"),
    "oracle.cli": ("fail_input", "oracle.cli.common"),
}


def imported(name):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = importlib.import_module(name)
    return module, [str(w.message) for w in caught if w.category is DeprecationWarning]


@pytest.mark.parametrize("old", sorted(k for k, v in MOVED.items() if len(v) == 1))
def test_a_module_moved_whole_is_itself_under_its_old_name(old):
    sys.modules.pop(old, None)
    module, said = imported(old)
    assert module is importlib.import_module(MOVED[old][0])
    assert any(f"{old} moved to {MOVED[old][0]}" in s for s in said), said


@pytest.mark.parametrize("old", sorted(NAMES))
def test_a_split_modules_names_are_found_where_they_went(old):
    name, home = NAMES[old]
    module, _ = imported(old)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(module, name)
    assert value is getattr(importlib.import_module(home), name)
    assert [str(w.message) for w in caught] == [f"{old}.{name} moved to {home}.{name} in the reorganisation of "
                                                 "2026-12 (removed in the next release)"]
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


def test_the_old_backend_names_resolve():
    from oracle.backend import BUILTIN, resolve

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        for old, new in (("exporters.eager:BACKEND", "eager"), ("exporters.hf:BACKEND", "hf"),
                         ("exporters.mlx:BACKEND", "mlx"), ("exporters.iree:BACKEND", "iree-llvm-cpu")):
            assert type(resolve(old)) is type(resolve(new)), (old, BUILTIN[new])


def test_python_m_of_an_old_path_runs_the_new_module():
    r = subprocess.run([sys.executable, "-W", "always::DeprecationWarning", "-m", "oracle.baseline", "--help"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "usage: python -m oracle.reports.baseline" in r.stdout
    assert "oracle.baseline moved to oracle.reports.baseline" in r.stderr

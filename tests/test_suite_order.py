"""The suite's imports do not depend on which files share a process.

pytest-xdist hands test files to workers by timing, so on another machine other files share a
process. At 98f7205 `tests/test_llamacpp.py tests/test_insitu.py tests/test_executorch.py
tests/test_contract.py` in one worker failed four contract tests ("No module named
'tests.plugins'"): `tests` was a namespace package, imported for the first time while another
project's regular `tests` package (gguf-py's) was first on sys.path. Now `tests` is a regular
package (tests/__init__.py) and pytest imports the conftest as `tests.conftest` at the start of
every process, so `tests` is this suite's before any test runs, whatever a test then puts on
sys.path. Proved here by the worst case: one process that first puts a foreign `tests` package
at the front of sys.path for good, then runs those four files in that order (llama.cpp's gguf
import, the in-situ and ExecuTorch modules, then every contract test)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FILES = ("tests/test_llamacpp.py", "tests/test_insitu.py", "tests/test_executorch.py", "tests/test_contract.py")
SHADOW = '''
import sys


def test_a_foreign_tests_package_is_first_on_sys_path():
    from exporters.llamacpp.setup import gguf_module

    sys.path.insert(0, {decoy!r})  # a foreign regular `tests` package first on sys.path, for the rest of the process
    try:
        gguf_module()  # llama.cpp's gguf-py, which carries a `tests` package of its own
    except Exception:
        pass  # not installed here: the decoy alone is the worst case
    assert sys.path[0] == {decoy!r}
'''


def test_the_four_files_pass_in_one_process_after_a_foreign_tests_package(tmp_path):
    decoy = tmp_path / "decoy"
    (decoy / "tests").mkdir(parents=True)
    (decoy / "tests" / "__init__.py").write_text("FOREIGN = True\n")
    shadow = tmp_path / "test_aaa_shadow.py"
    shadow.write_text(SHADOW.format(decoy=str(decoy)))
    # every file collected (its imports run in this one process); of the three heavy ones, the tests
    # that run no lowering, then every contract test (four of which load tests.plugins)
    select = "shadow or test_contract or round_blocks or rounded_activations"
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:xdist", "-p", "no:cacheprovider",
                        "--rootdir", str(ROOT), str(shadow), *FILES, "-k", select],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    assert " passed" in tail and "No module named 'tests" not in tail, tail


def test_every_deep_key_names_a_test_of_the_suite():
    """tests/depth.py's DEEP (the tests `make test` leaves to `make test-deep`) names tests that exist: a renamed or
    removed test would otherwise leave its key behind, and a new test under the old name would leave the quick tier
    silently. A case key ([id]) names a parametrised test."""
    import ast

    from tests.depth import DEEP

    assert DEEP
    for key in DEEP:
        file, name = key.split("::")
        func, case = name.split("[")[0], "[" in name
        tree = ast.parse((ROOT / "tests" / file).read_text())
        defs = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert func in defs and func.startswith("test_"), key
        if case:
            assert any("parametrize" in ast.unparse(d) for d in defs[func].decorator_list), key

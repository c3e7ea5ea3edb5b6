"""Where llama.cpp's converter comes from: the source distribution of the installed llama-cpp-python
(the wheel has none of it), fetched by `python -m exporters.llamacpp setup` (make setup) into the
environment, and gguf-py, the converter's own GGUF reader and writer, from there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from oracle.cache.artifacts import versions

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"  # the converter is fetched for the installed version; this one is tested


def installed_version() -> str | None:
    return versions(PACKAGE)[PACKAGE]


def converter_dir() -> Path:
    """Where `setup` keeps the installed version's converter (convert_hf_to_gguf.py, conversion/, gguf-py/):
    beside the installed package, in the environment's share/ (MOE_ORACLE_LLAMACPP_CONVERTER: elsewhere), so
    that every cache directory of the same environment finds it."""
    where = os.environ.get("MOE_ORACLE_LLAMACPP_CONVERTER")
    if where:
        return Path(where)
    return Path(sys.prefix) / "share" / "moe-oracle" / "llama.cpp" / str(installed_version()) / "llama.cpp"


CONVERTER_FILES = ("convert_hf_to_gguf.py", "conversion", "gguf-py")


def converter_problem() -> str | None:
    d = converter_dir()
    if all((d / f).exists() for f in CONVERTER_FILES):
        return None
    return (f"llama.cpp's converter is not set up for {PACKAGE} {installed_version()} ({d} is missing): "
            "run `make setup` or `python -m exporters.llamacpp setup` (fetches the package's source from PyPI)")


def setup() -> Path:
    """Fetch the installed version's sdist (pip download, cached by pip) and keep its converter."""
    version = installed_version()
    if version is None:
        raise RuntimeError(f"{PACKAGE} is not installed (pip install 'moe-oracle[llamacpp]')")
    target = converter_dir()
    if converter_problem() is None:
        return target
    import tarfile

    with tempfile.TemporaryDirectory(prefix="moe-oracle-llamacpp-") as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                        f"{PACKAGE}=={version}", "-d", tmp], check=True)
        sdist = next(Path(tmp).glob("*.tar.gz"))
        out = Path(tmp) / "out"
        with tarfile.open(sdist) as tar:
            prefix = f"{tar.getnames()[0].split('/')[0]}/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)
                       and m.name[len(prefix):].split("/")[0] in CONVERTER_FILES]
            tar.extractall(out, members=members, filter="data")
        staged = out / prefix
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        shutil.move(str(staged), str(target))
    return target


def gguf_module():
    """gguf-py as the converter ships it (its GGUFReader, GGUFWriter and dequantizer)."""
    # first on sys.path only while it is imported: gguf-py also holds a `tests` package, which
    # would otherwise shadow this project's for the rest of the process
    path = str(converter_dir() / "gguf-py")
    sys.path.insert(0, path)
    try:
        import gguf
    finally:
        sys.path.remove(path)
    return gguf

"""llama.cpp's own converter (convert_hf_to_gguf.py), run in one child process that converts GGUF
after GGUF (its imports paid once), with the synthetic vocabulary a tiny checkpoint needs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from exporters.llamacpp.setup import PACKAGE, converter_dir, installed_version
from oracle.backend import InputError

# the converter's own output types, and llama-quantize's (from the f32 GGUF) that users ship
CONVERTER_TYPES = ("f32", "bf16", "f16", "q8_0")
UNSUPPORTED = 3  # the child's exit status where the converter registers no class for the architecture


# ---------------------------------------------------------------- conversion (child process)

def convert(model_dir: Path, out: Path, outtype: str) -> dict:
    """The checkpoint at `model_dir` as a GGUF at `out` by llama.cpp's converter (in CONVERTER's child
    process). InputError with the converter's own reason where it does not support the model (an architecture it
    does not register, or its own "not supported"): a refusal. The converter's exception on an architecture it
    registers (a KeyError on a field transformers' AutoConfig folded away, a tensor it cannot map) is a defect of the
    candidate on this checkpoint, not a refusal: LoadError (exporters.llamacpp.runtime), the check's error at load,
    an expected failure where goldens/known_divergences.toml has the family's entry (fails = ["load"])."""
    rc, result, text = CONVERTER.run(Path(model_dir), Path(out), outtype)
    if rc != 0:
        # the converter's own reason: its last exception line (or its message of an unsupported model)
        lines = [x.strip() for x in text.splitlines() if x.strip()]
        reason = next((x for x in reversed(lines) if "not supported" in x or
                       (x.split(":", 1)[0].endswith(("Error", "Exception")) and " " not in x.split(":", 1)[0])),
                      lines[-1] if lines else f"exit {rc}")
        where = next((x for x in reversed(lines) if x.startswith("File ") and "/conversion/" in x), "")
        where = f" (at {where.split('/conversion/', 1)[1]})" if where else ""
        message = (f"llama.cpp's converter (convert_hf_to_gguf.py of {PACKAGE} {installed_version()}) cannot "
                   f"convert this checkpoint: {reason}{where}")
        if rc != UNSUPPORTED and "not supported" not in reason and "Traceback (most recent call last)" in text:
            from exporters.llamacpp.runtime import LoadError

            raise LoadError(message)
        raise InputError(message)
    return result


class Converter:
    """llama.cpp's converter in one child process that converts one checkpoint after another (`python -m
    exporters.llamacpp convert-server`): its imports (torch and the converter, 3-4 s of a tiny checkpoint's
    4.6 s) paid once per process, not per GGUF. A child process still (the converter puts its own `gguf`
    first on sys.path); each conversion's output goes to a file of its own; a child that holds more than
    RECYCLE_BYTES after a conversion (a real-width one) is ended, and one that died (a crash, the
    kernel's OOM killer) is that conversion's error and replaced by the next."""

    RECYCLE_BYTES = 3 << 29  # 1.5 GiB: after a tiny checkpoint's conversion the child holds about 0.35 GiB

    def __init__(self):
        self.proc, self.where = None, None
        self.lock = threading.Lock()

    def run(self, model_dir: Path, out: Path, outtype: str) -> tuple[int, dict | None, str]:
        """(exit status, the converter's summary or None, its output)."""
        with self.lock:
            where = str(converter_dir())
            if self.proc is not None and (self.proc.poll() is not None or self.where != where):
                self.close()
            if self.proc is None:
                self.proc = subprocess.Popen([sys.executable, "-m", "exporters.llamacpp", "convert-server", where],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                             cwd=Path(__file__).resolve().parents[2])
                self.where = where
            fd, log = tempfile.mkstemp(prefix="moe-oracle-convert-", suffix=".log")
            os.close(fd)
            try:
                try:
                    self.proc.stdin.write(json.dumps({"model_dir": str(model_dir), "out": str(out),
                                                      "outtype": outtype, "log": log}) + "\n")
                    self.proc.stdin.flush()
                    line = self.proc.stdout.readline()
                except (BrokenPipeError, OSError):
                    line = ""
                except BaseException:  # interrupted: its reply would answer the next conversion's question
                    self.proc.kill()
                    self.close()
                    raise
                text = Path(log).read_text(errors="replace")
            finally:
                os.unlink(log)
            if not line:  # the child died during the conversion
                rc = self.proc.wait()
                self.proc = None
                return rc or 1, None, text
            reply = json.loads(line)
            if reply["held"] > self.RECYCLE_BYTES:
                self.close()
            return reply["rc"], reply["result"], text

    def close(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            try:
                proc.stdin.close()
                proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                proc.kill()
                proc.wait()


CONVERTER = Converter()


def convert_server(where: str) -> None:
    """In the child: conversions read from stdin (one JSON object a line), each with its stdout and stderr
    in the file it names; one reply line each ({"rc", "result", "held": resident bytes}) on the original stdout."""
    import resource
    import traceback

    from oracle.check import resident_bytes

    sys.path[:0] = [where, str(Path(where) / "gguf-py")]
    replies = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        job = json.loads(line)
        saved = os.dup(1), os.dup(2)
        with open(job["log"], "w") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            rc, result = 0, None
            try:
                result = _convert(job["model_dir"], job["out"], job["outtype"])
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:  # noqa: BLE001 - the conversion's error, told to the parent
                traceback.print_exc()
                rc = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
        # what it keeps now (Linux's ru_maxrss would include the parent's resident memory at the fork before exec)
        held = resident_bytes()
        if held is None:
            held = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
        replies.write(json.dumps({"rc": rc, "result": result, "held": held}) + "\n")
        replies.flush()


def convert_main(model_dir: str, out: str, outtype: str) -> None:
    """`python -m exporters.llamacpp convert`: one conversion, its summary printed as JSON."""
    d = converter_dir()
    sys.path[:0] = [str(d), str(d / "gguf-py")]
    print(json.dumps(_convert(model_dir, out, outtype)))


def _convert(model_dir: str, out: str, outtype: str) -> dict:
    """In the child: llama.cpp's converter, with a synthetic vocabulary where the checkpoint has no tokenizer
    (the converter's directory and its gguf-py first on sys.path); its summary."""
    import logging

    logging.basicConfig(level=logging.WARNING)
    import gguf
    import torch
    from conversion import ModelBase, ModelType, get_model_architecture, get_model_class

    ftype = {"f32": gguf.LlamaFileType.ALL_F32, "bf16": gguf.LlamaFileType.MOSTLY_BF16,
             "f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    hparams = ModelBase.load_hparams(Path(model_dir), False)
    arch = get_model_architecture(hparams, ModelType.TEXT)
    try:
        cls = get_model_class(arch)
    except NotImplementedError:
        print(f"Error: model architecture {arch} is not supported by convert_hf_to_gguf.py", file=sys.stderr)
        sys.exit(UNSUPPORTED)
    if getattr(cls, "supports_mtp_export", False):
        cls.no_mtp = True  # --no-mtp: the check is of the model, not of a multi-token-prediction head
    tokenizer = any((Path(model_dir) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
    with torch.inference_mode():
        model = cls(Path(model_dir), ftype, Path(out))
        if not tokenizer:
            n = hparams.get("vocab_size") or hparams.get("text_config", {}).get("vocab_size")

            def synthetic_vocab():
                w = model.gguf_writer
                w.add_tokenizer_model("llama")
                w.add_tokenizer_pre("default")
                w.add_token_list([f"<t{i}>".encode() for i in range(n)])
                w.add_token_scores([0.0] * n)
                w.add_token_types([gguf.TokenType.NORMAL] * n)

            model.set_vocab = synthetic_vocab
            if any(c.__name__ == "Gemma3Model" for c in cls.__mro__):
                # Gemma 3's and 4's classes trim the embedding to the size of tokenizer.json's vocabulary: the
                # checkpoint seen through a directory of links with a tokenizer.json of the synthetic vocabulary's size
                seen = Path(tempfile.mkdtemp(prefix="synthetic-vocab-"))
                for f in Path(model_dir).iterdir():
                    (seen / f.name).symlink_to(f.resolve())
                (seen / "tokenizer.json").write_text(json.dumps({"model": {"vocab": {f"<t{i}>": i for i in range(n)}},
                                                                "added_tokens": []}))
                model.dir_model = seen
        model.write()
    return {"architecture": arch, "gguf_arch": model.model_arch_name if hasattr(model, "model_arch_name")
            else str(model.model_arch), "synthetic_vocab": not tokenizer}

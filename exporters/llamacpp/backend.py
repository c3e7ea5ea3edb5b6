"""llama.cpp as a backend: the checkpoint converted to GGUF by llama.cpp's own converter, run by
llama.cpp (llama-cpp-python's build of it) with its own KV cache.

- **Export**: `convert_hf_to_gguf.py` and its `conversion/` package and `gguf-py`, from the
  llama-cpp-python source distribution of the installed version (the wheel has none of them:
  `python -m exporters.llamacpp setup`, run by `make setup`, fetches that sdist from the package
  registry and keeps those three in `<env>/share/moe-oracle/llama.cpp/<version>/`; never a copy in this
  repository). The converter runs in a child process (it puts its own `gguf` first on sys.path),
  one a process that converts GGUF after GGUF (`Converter`: its imports paid once).
  A tiny checkpoint has no tokenizer: the converter's `set_vocab` is given a synthetic SPM
  vocabulary of `vocab_size` tokens (the check feeds token ids; llama.cpp never tokenizes).
  `--option outtype=` f32 (the fp32 check's), bf16, q8_0 (the converter's own types), or a
  llama-quantize type (Q8_0, Q6_K, Q5_K_M, Q4_K_M: `llama_model_quantize` on the f32 GGUF), the
  quantized ones for `oracle export` (then checked with `--gguf`).
- **A GGUF as shipped** (`--gguf`, `artifact_weights`): exporters/llamacpp/gguf.py.
- **Run**: prefill is one `llama_decode` of the tokens, decode one token at its position, the KV
  cache llama.cpp's (`--option kv=f32|f16`: f32 at fp32, f16 what users run by default; likewise
  `flash_attn` and `repack`, the CPU's repacked weight buffers: off at fp32, llama.cpp's default else).
- **Block rows, in-situ**: the eval callback (`cb_eval`) reads the graph's tensors while the
  sequence runs: a layer is `l_out-L`, its attention the branch added to the stream into
  `ffn_inp-L` (the operand of that ADD that is not the layer's input, a residual SCALE undone), its
  experts the branch added into `l_out-L`, its router `ffn_moe_topk-L` and the last
  `ffn_moe_weights*-L`, the final norm `result_norm`, the logits `result_output`; each block's own
  input is its norm's output (`attn_norm-L`, `ffn_norm-L`: Candidate.block_input). The expert
  probes (the reference's inputs to a MoE) are run by writing them over `ffn_norm-L` in the
  callback, in a sequence of their own; so is the drill of a router or a MoE (its points:
  `ffn_moe_logits`, `ffn_moe_probs`, `ffn_moe_probs_biased`, `ffn_moe_topk`, `ffn_moe_weights*`,
  `ffn_moe_out`, `ffn_shexp_gate_inp`, `ffn_shexp`). Attention's points are not mapped (the
  converter permutes q/k rows for some architectures): its drill is n/a.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import time
from pathlib import Path

from exporters.llamacpp.candidate import LlamaCppCandidate
from exporters.llamacpp.converter import CONVERTER, CONVERTER_TYPES, convert
from exporters.llamacpp.runtime import FLASH_ATTN, KV_TYPES, LoadError, quiet_logs
from exporters.llamacpp.setup import PACKAGE, converter_problem, installed_version
from oracle.backend import Backend, InputError, Option
from oracle.cache.artifacts import Artifact, cached_artifact, sha256_file, source_digest, versions
from oracle.cache.store import estimate

QUANTIZE_TYPES = {"Q8_0": 7, "Q6_K": 18, "Q5_K_M": 17, "Q4_K_M": 15}  # llama_ftype values


# a process forked from this one (a matrix's or a self-test's warm server) starts its own child: the pipes of
# this one's are not its to write
os.register_at_fork(after_in_child=CONVERTER.__init__)


class LlamaCppBackend(Backend):
    """llama.cpp on a GGUF converted by its own converter from the checkpoint (cached)."""

    name = "llamacpp"
    runs_torch = False
    cache_namespaces = ("llamacpp", "llamacpp-map")
    artifact_suffix = ".gguf"  # --gguf FILE: a GGUF as shipped (exporters/llamacpp/gguf.py)
    precisions = ("fp32", "bf16")
    option_schema = (
        Option("outtype", str, CONVERTER_TYPES + tuple(QUANTIZE_TYPES), None,
               "the GGUF's type: the converter's (f32: the fp32 check's; bf16: the bf16 check's) or a "
               "llama-quantize type from the f32 GGUF"),
        Option("kv", str, tuple(KV_TYPES), None, "the KV cache's type (default f32 at fp32, f16 otherwise: "
               "llama.cpp's default, what users run)"),
        Option("flash_attn", str, tuple(FLASH_ATTN), None, "llama.cpp's flash attention (default off at fp32: "
               "its CPU kernel reads K and V as f16 whatever the cache's type; auto otherwise, llama.cpp's default)"),
        Option("repack", str, ("on", "off"), None, "llama.cpp's CPU extra buffer types for quantized weights "
               "(AMX where the CPU has it, interleaved repacking): default off at fp32, on otherwise (llama.cpp's "
               "default). On an AMX host llama.cpp 0.3.36 crashes on tiny Q8_0 models with them (docs/llamacpp.md)"),
    )

    def __init__(self, name: str = "llamacpp", transform=None, transform_id: str | None = None):
        self.name, self.transform, self.transform_id = name, transform, transform_id

    def availability(self):
        if installed_version() is None:
            return False, f"{PACKAGE} not installed (pip install 'moe-oracle[llamacpp]': a source build of llama.cpp)"
        try:
            import llama_cpp  # noqa: F401
        except Exception as e:  # noqa: BLE001 - a broken build: say why
            return False, f"llama_cpp cannot be imported: {type(e).__name__}: {e}"
        problem = converter_problem()
        return (False, problem) if problem else (True, "")

    def settings(self, spec) -> tuple[str, str, str, str]:
        """(outtype, kv, flash_attn, repack): at fp32 an f32 GGUF, an f32 KV cache, no flash attention and
        no repacked weight buffers; else a bf16 GGUF with llama.cpp's defaults (f16 KV cache, flash
        attention auto, repacking on)."""
        fp32 = spec.precision in ("fp32", "a8", "abf16", "af16")  # a GGUF as shipped, at the fp32 settings
        o = spec.options
        return (o.get("outtype") or ("f32" if fp32 else "bf16"), o.get("kv") or ("f32" if fp32 else "f16"),
                o.get("flash_attn") or ("off" if fp32 else "auto"), o.get("repack") or ("off" if fp32 else "on"))

    def gguf(self, src, spec) -> Artifact:
        """The checkpoint as a GGUF of `outtype` (cached by checkpoint, type, version and code)."""
        outtype = self.settings(spec)[0]
        base = "f32" if outtype in QUANTIZE_TYPES else outtype
        code = source_digest("exporters/llamacpp/backend.py", "exporters/llamacpp/converter.py",
                             "exporters/llamacpp/faults.py")
        parts = {"backend": "llamacpp", "checkpoint": src.checkpoint_sha256, "outtype": base,
                 "versions": versions(PACKAGE), "code": code, "transform_id": self.transform_id}

        def build(path: Path):
            convert(src.model_dir, path, base)
            if self.transform is not None:
                try:
                    self.transform(path, src.args)
                except KeyError as e:  # a key or tensor this GGUF does not have (its architecture reads none)
                    raise InputError(f"the fault has no form in this GGUF: {e.args[0]}") from None

        art = cached_artifact("llamacpp", parts, "model.gguf", build,
                              needed=lambda: estimate(src.parameter_count(), base))
        if outtype not in QUANTIZE_TYPES:
            return art

        def quantize(path: Path):
            import llama_cpp as L

            quiet_logs()
            qp = L.llama_model_quantize_default_params()
            qp.ftype = QUANTIZE_TYPES[outtype]
            rc = L.llama_model_quantize(art.path.encode(), str(path).encode(), ctypes.byref(qp))
            if rc != 0:
                raise RuntimeError(f"llama_model_quantize to {outtype} returned {rc}")

        return cached_artifact("llamacpp", {**parts, "quantize": outtype}, "model.gguf", quantize,
                               needed=lambda: estimate(src.parameter_count(), outtype))

    def artifact_weights(self, original, path: Path, progress):
        """--gguf: the GGUF's weights as an HF checkpoint (exporters/llamacpp/gguf.py), checked against the
        original's f32 conversion by the same converter (architecture, hyper-parameters, tensors)."""
        from exporters.llamacpp.gguf import dequantized_gguf
        from oracle.backend import CheckSpec

        progress("converting the original (llama.cpp's converter, f32) to compare the GGUF with")
        ref = self.gguf(original, CheckSpec(family=original.family.name, backend=self.name))
        return dequantized_gguf(original.family, original, path, Path(ref.path), f"{PACKAGE} {installed_version()}",
                                progress)

    # `oracle selftest --conversion`: what users ship, an F32 file (whose weights must be the original's
    # exactly) and two of llama-quantize's types
    shipped_formats = (("F32", "fp32", {"outtype": "f32"}), ("Q8_0", "fp32", {"outtype": "Q8_0"}),
                       ("Q4_K_M", "fp32", {"outtype": "Q4_K_M"}))
    file_faults = {"scale_other_block": "each block's scale written for the next block, in one quantized tensor "
                                        "(last MoE layer)"}

    def apply_file_fault(self, name, path, original, args, progress):
        from exporters.llamacpp.weights import scale_other_block
        from oracle.selftest.conversion_faults import last_sparse

        return scale_other_block(Path(path), last_sparse(args)) if name == "scale_other_block" else None

    def shipped_tensors(self, original, path, progress):
        """The weight check of a --gguf (exporters/llamacpp/weights.py): each tensor against the original's f32
        conversion by the same converter, labelled with the HF tensors the converter's element map puts there."""
        from exporters.llamacpp.gguf import element_map
        from exporters.llamacpp.weights import gguf_tensor_sources, labels_from_map
        from oracle.backend import CheckSpec

        ref = self.gguf(original, CheckSpec(family=original.family.name, backend=self.name))
        labels = labels_from_map(element_map(original, f"{PACKAGE} {installed_version()}"))
        return gguf_tensor_sources(Path(path), Path(ref.path), labels)

    def arithmetic(self, src, spec):
        """a8 for a release whose packed tensors the converter keeps packed (gpt-oss's MXFP4 experts: GGML's
        MXFP4, whose dot products take the activations as Q8_0 blocks, ggml-cpu vec_dot_type), at the fp32
        settings; None else (an FP8 release is dequantized by the converter: its GGUF is the outtype's)."""
        from models.release_formats import MXFP4, release_format

        fmt = release_format(src.config)
        if spec.artifact is None and fmt is not None and fmt.method == MXFP4 and self.settings(spec)[0] == "f32":
            return "a8"
        return None

    def check_options(self, spec):
        if spec.artifact is not None and spec.options.get("outtype"):
            return "--gguf runs the file as given: outtype applies to the GGUF the backend converts, not to it"
        return None

    def load(self, src, spec):
        outtype, kv, fa, repack = self.settings(spec)
        if spec.artifact is None and (outtype in QUANTIZE_TYPES or outtype == "q8_0"):
            # judged against HF on the original weights, a quantized GGUF fails by its quantization alone
            raise InputError(f"outtype={outtype} is a quantized GGUF: check it as shipped, its implementation on its "
                             f"own weights and its quantization apart: `oracle export --backend llamacpp --option "
                             f"outtype={outtype} --output-dir D`, then `oracle check --backend llamacpp --gguf D/model.gguf`")
        t = time.perf_counter()
        if spec.artifact is not None:  # --gguf: the file as shipped
            art = Artifact(Path(spec.artifact).name, str(spec.artifact), sha256_file(Path(spec.artifact)), True, 0.0)
            outtype = "given"
        else:
            art = self.gguf(src, spec)
        info = {"executor": f"llama.cpp ({PACKAGE} {installed_version()}), CPU, KV cache {kv}, flash attention {fa}, "
                            f"repacked weights {repack}",
                "gguf": {"outtype": outtype, "kv": kv, "flash_attn": fa, "repack": repack, "converter": f"convert_hf_to_gguf.py of {PACKAGE} "
                                                                     f"{installed_version()}"},
                "artifacts": [art.as_dict()]}
        n_ctx = max(src.args.max_seq_len, 2 * (src.args.num_experts or 1), 32)
        try:
            cand = LlamaCppCandidate(Path(art.path), n_ctx, kv, info, flash_attn=fa, repack=repack)
            cand.post_normed = src.args.norm.placement != "pre"  # the blocks' outputs read before their post-norms
        except RuntimeError as e:  # llama.cpp cannot load or run what its own converter wrote (or the given
            # GGUF, checked against that conversion): a defect of the candidate, the check's error with its reason
            made = "the given GGUF" if spec.artifact is not None else "the GGUF llama.cpp's converter wrote"
            raise LoadError(f"{e} ({made} from this checkpoint)") from None
        if src.args.shared_expert_beside:  # HF's MoE block is the routed experts alone (Granite's shared_mlp beside)
            cand.moe_tensor = "experts"
        if src.args.moe_beside_mlp:  # a MoE block beside a dense MLP, fed the stream itself, its norms its own
            # (Gemma 4's, models.args.block_input_path): its rows read that stream and the experts' sum post-normed
            cand._call("set_stream_fed", True)
            cand.moe_tensor = "moe_normed"
        cand.info["load_s"] = round(time.perf_counter() - t, 3)
        return cand

    def with_fault(self, fault):
        """This backend with a GGUF fault (exporters/llamacpp/faults.py) written into the converted GGUF."""
        from exporters.llamacpp import faults as llamacpp_faults

        if fault not in llamacpp_faults.CATALOGUE:
            return None
        return type(self)(f"{self.name}+{fault.name}", lambda path, args: fault.apply(path, fault.layer(args), args),
                          fault.name)

    def fault_not_applicable(self, fault):
        return ("a fault of the torch production model: llama.cpp runs the GGUF, whose faults are "
                "exporters/llamacpp/faults.py's")

    def fault_catalogue(self, args):
        from exporters.llamacpp import faults as llamacpp_faults

        return list(llamacpp_faults.CATALOGUE) if args is None else llamacpp_faults.applicable(args)

    def export(self, src, spec, output_dir: Path) -> list[Path]:
        art = self.gguf(src, spec)
        out = Path(output_dir) / "model.gguf"
        shutil.copyfile(art.path, out)
        return [out]


BACKEND = LlamaCppBackend()

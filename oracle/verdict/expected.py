"""Known candidate defects as data (goldens/known_divergences.toml): a real defect of a candidate
that cannot be fixed here (an upstream bug) is neither a refusal nor a loosened limit. The check
runs and its rows fail as usual; when it fails exactly where the entry says, its status is
`xfail` ("expected failure: <cause>", exit 0, not gating). It turns red (`fail`) when it passes
(the entry is stale: the upstream fixed it, remove the entry) or fails anywhere else. A defect that
shows only on some inputs (`on_some_inputs`: its cause says which) is not stale when a check passes:
those inputs were not met; a test of its own (tests/test_mlx.py) says when upstream has fixed it.

An entry: family, backend, the package whose versions have the defect and their range (a PEP 440
specifier set), the precisions (all when absent), `fails` (the row kinds it fails: block kinds
such as `router` or `layer`, `e2e`, `prompts`, `gate:<name>`, or `load`: the candidate cannot load
or aborts when loaded, its runtime's reason in the check's error), the cause, an upstream
reference, `on_some_inputs` (default false), and `release` (the released quantized formats, quant_method, whose
checkpoints it applies to, e.g. ["fp8"]; default: every checkpoint). Where several entries apply (a family's
defect and a release format's), the check is judged against all of them: their `fails` together, each cause told.
Entries are validated when read: a malformed file is refused with its path.
"""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, replace

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from oracle.verdict.goldens import root
from oracle.reports.result import Status

FILE = "known_divergences.toml"


@dataclass(frozen=True)
class Divergence:
    family: str
    backend: str
    package: str
    versions: str
    fails: tuple[str, ...]
    cause: str
    reference: str
    precisions: tuple[str, ...] = ()
    on_some_inputs: bool = False  # the defect needs inputs the cause names: a pass is not stale
    release: tuple[str, ...] = ()  # the release formats (quant_method) it applies to; () every checkpoint

    def applies(self, family: str, backend: str, precision: str, versions: dict, release: str | None = None) -> bool:
        have = versions.get(self.package)
        if (family, backend) != (self.family, self.backend) or have is None:
            return False
        if self.precisions and precision not in self.precisions:
            return False
        if self.release and release not in self.release:
            return False
        try:
            return Version(have) in SpecifierSet(self.versions)
        except InvalidVersion:
            return False


# path -> (its text, its entries): a check reads the file twice, a self-test hundreds of times; parsed again
# only when the text changed
_READ: dict = {}


def load(path=None) -> list[Divergence]:
    """Every entry of the data file (none when it does not exist); ValueError naming the file
    and the entry when it is malformed."""
    path = path or root() / FILE
    if not path.is_file():
        return []
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: {e}") from None
    if _READ.get(str(path), (None,))[0] != text:
        _READ[str(path)] = (text, tuple(_parse(path, text)))
    return list(_READ[str(path)][1])


def _parse(path, text: str) -> list[Divergence]:
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: {e}") from None
    out = []
    for i, entry in enumerate(doc.get("divergence", [])):
        where = f"{path}: divergence #{i + 1}"
        fields = {f: entry.get(f) for f in Divergence.__dataclass_fields__}
        missing = [f for f in ("family", "backend", "package", "versions", "fails", "cause", "reference")
                   if not fields[f]]
        unknown = sorted(set(entry) - set(fields))
        if missing or unknown:
            raise ValueError(f"{where}: missing {missing}" if missing else f"{where}: unknown keys {unknown}")
        try:
            SpecifierSet(fields["versions"])
        except InvalidSpecifier:
            raise ValueError(f"{where}: versions {fields['versions']!r} is not a PEP 440 specifier set") from None
        if not isinstance(fields["on_some_inputs"], (bool, type(None))):
            raise ValueError(f"{where}: on_some_inputs must be true or false, not {fields['on_some_inputs']!r}")
        from models.release_formats import METHODS

        release = fields["release"]
        if release is not None and (not isinstance(release, list) or not set(release) <= set(METHODS)):
            raise ValueError(f"{where}: release must be a list of release formats ({', '.join(METHODS)}), not {release!r}")
        out.append(Divergence(**{**fields, "fails": tuple(fields["fails"]),
                                 "precisions": tuple(fields["precisions"] or ()),
                                 "release": tuple(fields["release"] or ()),
                                 "on_some_inputs": bool(fields["on_some_inputs"])}))
    return out


def failing_parts(result) -> list[str]:
    """What failed in a CheckResult, in the vocabulary of `fails`."""
    parts = [b.kind for b in result.blocks if b.status in (Status.FAIL, Status.ERROR)]
    if result.e2e is not None and result.e2e.status in (Status.FAIL, Status.ERROR):
        parts.append("e2e")
    parts += [f"gate:{g.name}" for g in result.gates if g.status in (Status.FAIL, Status.ERROR)]
    if (result.prompts or {}).get("status") == Status.FAIL:
        parts.append("prompts")
    if (result.quantization or {}).get("rows", {}).get("status") in (Status.FAIL, Status.ERROR):
        parts.append("quantization")
    if result.status == Status.ERROR and (result.error or "").startswith("load:"):
        parts.append("load")  # the candidate could not be loaded or aborted there (its runtime's reason)
    return list(dict.fromkeys(parts))


def applying(result, entries: list[Divergence] | None = None) -> Divergence | None:
    """The known divergence of this check's candidate: the one entry that applies, or the entries that do as
    one (their fails together, their causes and references each told; a pass is not stale only where every one
    of them needs some inputs), or None."""
    spec, versions = result.spec, result.provenance.get("versions", {})
    release = (result.provenance.get("checkpoint") or {}).get("release_method")
    entries = load() if entries is None else entries
    found = [e for e in entries if e.applies(spec["family"], spec["backend"], spec["precision"], versions, release)]
    if len(found) <= 1:
        return found[0] if found else None
    return replace(found[0], fails=tuple(dict.fromkeys(f for e in found for f in e.fails)),
                   cause=" Also: ".join(e.cause for e in found), reference="; ".join(e.reference for e in found),
                   on_some_inputs=all(e.on_some_inputs for e in found))


def known_fails(result, entries: list[Divergence] | None = None) -> tuple[str, ...]:
    """The row kinds a known divergence of this check's candidate fails (its entry's `fails`), or ()."""
    entry = applying(result, entries)
    return entry.fails if entry else ()


def judge(result, entries: list[Divergence] | None = None) -> None:
    """Turn a check that fails as a known divergence says into `xfail`, and one whose known
    divergence did not show as said into `fail` with the reason. Sets result.expected."""
    if result.status not in (Status.PASS, Status.FAIL, Status.ERROR):
        return  # a skip is not a verdict on the candidate
    versions = result.provenance.get("versions", {})
    entry = applying(result, entries)
    if result.status == Status.ERROR and (entry is None or "load" not in entry.fails
                                          or "load" not in failing_parts(result)):
        return  # a crash is not a verdict on the candidate's numbers, unless its entry is that it cannot load
    if entry is None or (result.status == Status.PASS and entry.on_some_inputs):
        return  # (a defect that needs some inputs: these did not meet it)
    parts = failing_parts(result)
    elsewhere = [p for p in parts if p not in entry.fails]
    if result.status == Status.PASS:
        verdict, result.status = (f"stale: the expected failure did not happen ({entry.package} "
                                  f"{versions[entry.package]} passes): remove the entry from {FILE}"), Status.FAIL
    elif elsewhere:
        verdict = f"unexpected: it also fails {', '.join(elsewhere)}, outside the expected {', '.join(entry.fails)}"
    else:
        verdict, result.status = f"expected failure: {entry.cause}", Status.XFAIL
    result.expected = {**asdict(entry), "verdict": verdict, "failed": parts}

"""What lies outside PyTorch's caching allocator, per rank: the catalogue (``outside.yaml``) and its reading.

``torch.cuda.max_memory_reserved`` counts the segments the caching allocator took from the driver. A rank also holds
the CUDA context and the kernel modules loaded into it, NCCL's communicator buffers and unified-memory pages; the
cuBLAS/cuBLASLt workspaces, flash-attention's and bitsandbytes' buffers are *inside* the allocator (listed, never
added: counting them here would count them twice). :func:`estimate` gives, for a declared stack (GPU, CUDA, module
loading, ranks, NCCL settings), a per-rank figure with its parts, each with its sources and its range.
:func:`for_document` prefers what the ledger holds: ``outside_allocator.total`` MEASURED by ``ledgerspec measure
--device cuda`` (or declared by the user) replaces the catalogue's figure, and each of its parts (``context``, ``nccl``,
``other``) the catalogue's parts it names (:func:`with_declared`).

Provenance of a part as the ledger would record it: CALCULATED when it follows from the libraries' source and
inputs the ledger declares (NCCL's buffer formula with declared channels), ASSUMPTION otherwise (a public
measurement of another machine is not a measurement of yours; the note names it). Pure Python, no torch.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ledgerspec.contract.units import UnitError, format_size, parse_size
from ledgerspec.errors import EXIT_USAGE, LedgerspecError

CATALOGUE = Path(__file__).with_name("outside.yaml")
#: how the built-in catalogue is named in a ledger's method text (not the path where the package is installed)
BUILT_IN = "derivations/devices/outside.yaml"
MiB = 2**20


@dataclass(frozen=True)
class Source:
    id: str
    url: str
    what: str


@dataclass(frozen=True)
class Range:
    """A figure with its range (bytes) and what it rests on (``measured-public``, ``source`` or ``assumption``)."""

    typical: int
    low: int
    high: int
    basis: str
    sources: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class Library:
    name: str
    where: str  # inside the allocator | unified memory | host | not used
    note: str
    sources: tuple[str, ...]


@dataclass(frozen=True)
class Arch:
    arch: str
    pattern: str
    link: str  # nvlink | pcie


@dataclass(frozen=True)
class Catalogue:
    architectures: tuple[Arch, ...]
    pcie_pattern: str
    context: dict[str, Range]
    eager_modules: Range
    lazy_modules: Range
    cublas: dict[str, Any]
    nccl: dict[str, Any]
    libraries: tuple[Library, ...]
    sources: dict[str, Source]

    def source(self, ids: tuple[str, ...]) -> tuple[Source, ...]:
        return tuple(self.sources[i] for i in ids)


@dataclass(frozen=True)
class NcclSettings:
    """``software.nccl`` and ``parallelism.nccl``; None: NCCL's default (as this catalogue assumes it)."""

    version: str | None = None
    buffsize: int | None = None
    channels: int | None = None
    nvls_enable: bool | None = None
    runtime_connect: bool | None = None
    communicators: int | None = None


@dataclass(frozen=True)
class Stack:
    """What the memory outside the allocator depends on, as declared."""

    gpu_name: str | None = None
    cuda: str | None = None
    rocm: str | None = None
    torch: str | None = None
    module_loading: str = "LAZY"
    world_size: int = 1
    nccl: NcclSettings = field(default_factory=NcclSettings)
    paged_state: int | None = None  # bytes of a paged optimizer's state (None: no paged optimizer)
    paged: bool = False


@dataclass(frozen=True)
class Part:
    """One thing the device holds. ``inside_allocator`` parts are listed for completeness and never summed."""

    name: str
    typical: int
    low: int
    high: int
    provenance: str  # CALCULATED | ASSUMPTION
    formula: str
    sources: tuple[Source, ...]
    note: str = ""
    inside_allocator: bool = False
    #: the ledger's own figure (``outside_allocator.<name>``), not the catalogue's
    declared: bool = False

    @property
    def counted(self) -> bool:
        return not self.inside_allocator


@dataclass(frozen=True)
class Estimate:
    """The per-rank figure outside the allocator: the sum of the counted parts, with its range."""

    stack: Stack
    arch: str
    parts: tuple[Part, ...]

    @property
    def counted(self) -> tuple[Part, ...]:
        return tuple(p for p in self.parts if p.counted)

    @property
    def typical(self) -> int:
        return sum(p.typical for p in self.counted)

    @property
    def low(self) -> int:
        return sum(p.low for p in self.counted)

    @property
    def high(self) -> int:
        return sum(p.high for p in self.counted)

    @property
    def provenance(self) -> str:
        """The weakest of the counted parts' provenance (:data:`ledgerspec.contract.values.SOURCE_RANK`; a word it
        does not rank counts as an ASSUMPTION): MEASURED only when every part is, the catalogue's own parts being
        CALCULATED or ASSUMPTION."""
        from ledgerspec.contract.values import SOURCE_RANK

        kinds = [p.provenance for p in self.counted] or ["ASSUMPTION"]
        return min(kinds, key=lambda k: SOURCE_RANK.get(k, SOURCE_RANK["ASSUMPTION"]))

    def part(self, name: str) -> Part | None:
        return next((p for p in self.parts if p.name == name), None)

    def method(self) -> str:
        shown = ", ".join(
            f"{p.name} {format_size(p.typical)}" + (" (the ledger's)" if p.declared else "") for p in self.counted
        )
        return (
            f"ledgerspec {BUILT_IN} for {self.stack.gpu_name or 'an unnamed GPU'} ({self.arch}), "
            f"{self.stack.world_size} rank(s): {shown}; range {format_size(self.low)} to {format_size(self.high)}"
        )


# -- reading the catalogue ------------------------------------------------------------------------------------------


def _bad(message: str) -> LedgerspecError:
    return LedgerspecError(message, str(CATALOGUE), rule="devices", exit_code=EXIT_USAGE)


def _size(value: Any, what: str) -> int:
    try:
        return parse_size(value)
    except UnitError as exc:
        raise _bad(f"{what}: {exc}") from None


def _range(data: Any, what: str) -> Range:
    if not isinstance(data, dict):
        raise _bad(f"{what}: a mapping with typical, low, high, basis, sources")
    r = Range(
        _size(data["typical"], f"{what}.typical"),
        _size(data["low"], f"{what}.low"),
        _size(data["high"], f"{what}.high"),
        str(data["basis"]),
        tuple(data.get("sources") or ()),
        " ".join(str(data.get("note", "")).split()),
    )
    if not r.low <= r.typical <= r.high:
        raise _bad(f"{what}: low <= typical <= high does not hold")
    return r


_CATALOGUE: Catalogue | None = None


def load() -> Catalogue:
    """The built-in catalogue (read once)."""
    global _CATALOGUE
    if _CATALOGUE is None:
        from ruamel.yaml import YAML

        data = YAML(typ="safe").load(CATALOGUE.read_text(encoding="utf-8"))
        sources = {
            k: Source(k, str(v["url"]), " ".join(str(v["what"]).split())) for k, v in (data["sources"] or {}).items()
        }
        cat = Catalogue(
            architectures=tuple(Arch(a["arch"], a["pattern"], a["link"]) for a in data["architectures"]),
            pcie_pattern=str(data["pcie_pattern"]),
            context={k: _range(v, f"context.{k}") for k, v in data["context"].items()},
            eager_modules=_range(data["eager_modules"], "eager_modules"),
            lazy_modules=_range(data["lazy_modules"], "lazy_modules"),
            cublas=dict(data["cublas"]),
            nccl=dict(data["nccl"]),
            libraries=tuple(
                Library(x["name"], x["where"], " ".join(str(x["note"]).split()), tuple(x["sources"]))
                for x in data["libraries"]
            ),
            sources=sources,
        )
        named = {s for r in (*cat.context.values(), cat.eager_modules, cat.lazy_modules) for s in r.sources}
        named |= set(cat.cublas["sources"]) | set(cat.nccl["sources"])
        named |= {s for lib in cat.libraries for s in lib.sources}
        if named - set(sources):
            raise _bad(f"sources named but not listed: {sorted(named - set(sources))}")
        _CATALOGUE = cat
    return _CATALOGUE


def architecture(gpu_name: str | None, catalogue: Catalogue | None = None) -> tuple[str, str]:
    """(architecture, link) of a GPU name: ``("unknown", "pcie")`` for a name the catalogue does not know."""
    cat = catalogue or load()
    name = gpu_name or ""
    for a in cat.architectures:
        if re.search(a.pattern, name, re.IGNORECASE):
            link = "pcie" if re.search(cat.pcie_pattern, name, re.IGNORECASE) else a.link
            return a.arch, link
    return "unknown", "pcie"


def _version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    m = re.match(r"\s*(\d+)(?:\.(\d+))?(?:\.(\d+))?", text)
    return tuple(int(g) for g in m.groups() if g is not None) if m else None


def _provenance(basis: str) -> str:
    return "CALCULATED" if basis == "source" else "ASSUMPTION"


# -- the parts ------------------------------------------------------------------------------------------------------


def eager_loading(stack: Stack) -> bool:
    """Every module loaded at start: declared EAGER, or a stack without lazy loading (CUDA before 11.7; a torch
    before 1.13 leaves CUDA 11.7-12.1's default, eager, in place)."""
    cuda, torch = _version(stack.cuda), _version(stack.torch)
    if stack.rocm is not None:
        return stack.module_loading.upper() == "EAGER"
    if cuda is not None and cuda < (11, 7):
        return True
    if stack.module_loading.upper() == "EAGER":
        return True
    return torch is not None and torch < (1, 13) and (cuda is None or cuda < (12, 2))


def _context(stack: Stack, arch: str, cat: Catalogue) -> Part:
    r = cat.context.get(arch, cat.context["unknown"])
    eager = eager_loading(stack)
    e = cat.eager_modules
    note = r.note + (f"; CUDA_MODULE_LOADING=EAGER adds every library's modules: {e.note}" if eager else "")
    return Part(
        "context",
        r.typical + (e.typical if eager else 0),
        r.low + (e.low if eager else 0),
        r.high + (e.high if eager else 0),
        "ASSUMPTION",
        f"the CUDA context and the modules loaded with it on {arch}"
        + (" + every module of every library (EAGER loading)" if eager else " (lazy module loading)"),
        cat.source(r.sources + (e.sources if eager else ())),
        f"{r.basis}: {note}",
    )


def _lazy_modules(stack: Stack, cat: Catalogue) -> Part:
    r = cat.lazy_modules
    if eager_loading(stack):
        return Part(
            "other",
            0,
            0,
            r.low,
            "ASSUMPTION",
            "EAGER loading: the step's kernel modules are already in the context",
            cat.source(r.sources),
        )
    return Part(
        "other",
        r.typical,
        r.low,
        r.high,
        "ASSUMPTION",
        "kernel modules loaded at their first launch during the step, and the libraries' handles",
        cat.source(r.sources),
        f"{r.basis}: {r.note}",
    )


def _nccl(stack: Stack, arch: str, link: str, cat: Catalogue) -> Part:
    n = cat.nccl
    s = stack.nccl
    sources = cat.source(tuple(n["sources"]))
    world = stack.world_size
    if world < 2:
        return Part("nccl", 0, 0, 0, "CALCULATED", "one rank: no NCCL communicator", sources)
    simple = s.buffsize if s.buffsize is not None else _size(n["simple"], "nccl.simple")
    gran = _size(n["granularity"], "nccl.granularity")
    conn = int(n["ll"]) + int(n["ll128"]) + simple
    conn_rounded = -(-conn // gran) * gran
    ch = n["channels"][link]
    if s.channels is not None:
        c_typ = c_low = c_high = s.channels
    else:
        c_typ, c_low, c_high = int(ch["typical"]), int(ch["low"]), int(ch["high"])
    version = _version(s.version)
    new = version is None or version >= _version(str(n["nvls"]["smaller_since"]))  # type: ignore[operator]
    lazy_connect = new and s.runtime_connect is not False
    ring, tree = int(n["ring_connections"]), int(n["tree_connections"])
    typ_conns = ring if lazy_connect else ring + tree
    # NVLS
    nv = n["nvls"]
    nvls_on = (
        stack.rocm is None
        and arch in nv["archs"]
        and link == "nvlink"
        and s.nvls_enable is not False
        and (version is None or version >= _version(str(nv["since"])))  # type: ignore[operator]
    )
    heads = min(world, 8)
    nvls_channels = int(nv["channels"].get(arch, 16))
    if nvls_on and new:
        nvls = nvls_channels * 2 * int(nv["chunk"]) * int(nv["steps"]) * heads
        nvls_high = nvls
        nvls_text = f"NVLS {nvls_channels} ch x 2 x {int(nv['chunk']) // 1024} KiB x {nv['steps']} x {heads} heads"
    elif nvls_on:
        nvls = nvls_channels * 2 * (simple + _size(nv["old_mem"], "nvls.old_mem")) * heads
        nvls_high = nvls
        nvls_text = f"NVLS (NCCL < 2.22) {nvls_channels} ch x 2 x (buffsize + 2 MiB) x {heads} heads"
    else:
        nvls = nvls_high = 0
        nvls_text = "no NVLS"
    if nvls_on and version is None:  # an undeclared NCCL may be older than 2.22: its NVLS buffers were 6x larger
        nvls_high = nvls_channels * 2 * (simple + _size(nv["old_mem"], "nvls.old_mem")) * heads
    fixed = n["fixed"]
    comms = s.communicators if s.communicators is not None else 1
    typical = comms * (c_typ * typ_conns * conn + nvls + _size(fixed["typical"], "fixed"))
    low = comms * (c_low * ring * conn + nvls + _size(fixed["low"], "fixed"))
    high = comms * (c_high * (ring + tree) * conn_rounded + nvls_high + _size(fixed["high"], "fixed"))
    exact = s.channels is not None and s.version is not None
    formula = (
        f"{comms} communicator(s) x ({c_typ} channels x {typ_conns} connection(s) x (LL 512 KiB + LL128 4.6875 MiB + "
        f"Simple {format_size(simple)}) + {nvls_text} + fixed)"
    )
    note = (
        ("ring only: NCCL >= 2.22 connects what a collective uses" if lazy_connect else "ring + tree connected at init")
        + ("" if s.channels is not None else f"; channels assumed for a {link} board ({c_low} to {c_high})")
        + ("" if s.version is not None else "; NCCL version not declared: 2.22 or later assumed")
        + "; high: every connection rounded to NCCL's 2 MiB allocations, tree connected too"
    )
    return Part("nccl", typical, low, high, "CALCULATED" if exact else "ASSUMPTION", formula, sources, note)


def _paged(stack: Stack, cat: Catalogue) -> Part | None:
    if not stack.paged:
        return None
    lib = next(x for x in cat.libraries if "paged" in x.name)
    high = stack.paged_state or 0
    return Part(
        "unified memory",
        0,
        0,
        high,
        "ASSUMPTION",
        "bitsandbytes paged optimizer state (cudaMallocManaged): 0 to the paged state's bytes resident on the device",
        cat.source(lib.sources),
        lib.note + ("" if stack.paged_state is not None else "; the state's bytes are unknown (ledger.optimizer)"),
    )


def _handle_workspaces(arch: str, stack: Stack, cat: Catalogue) -> tuple[int, int, int]:
    """(cuBLAS workspace per handle, hipBLASLt's own per handle on ROCm else 0, handles) from the catalogue."""
    c = cat.cublas
    ws = c["workspace"]
    each = _size(ws.get(arch, ws["default"]), "cublas.workspace")
    lt = _size(c["lt_workspace_rocm"], "cublas.lt_workspace_rocm") if stack.rocm is not None else 0
    return each, lt, int(c["handles"])


def _arch_link(stack: Stack, cat: Catalogue) -> tuple[str, str]:
    """The stack's GPU architecture and link (:func:`architecture`); an unnamed GPU under ROCm is taken as gfx942."""
    arch, link = architecture(stack.gpu_name, cat)
    return ("gfx942" if stack.rocm is not None and arch == "unknown" else arch), link


def cublas_workspaces(stack: Stack, catalogue: Catalogue | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The workspaces (bytes each) of the Python thread's cuBLAS handle and of the autograd thread's, on the compute
    stream, for the replay (:mod:`ledgerspec.derivations.allocator.workspaces`): inside the allocator, so never in
    this module's sums; the step's tensor stream lacks them."""
    cat = catalogue or load()
    each, lt, handles = _handle_workspaces(_arch_link(stack, cat)[0], stack, cat)
    one = (each, lt) if lt else (each,)
    return one, (one if handles > 1 else ())


def _cublas(arch: str, stack: Stack, cat: Catalogue) -> Part:
    c = cat.cublas
    each, lt, handles = _handle_workspaces(arch, stack, cat)
    total = (each + lt) * handles
    return Part(
        "cuBLAS workspaces",
        total,
        each,
        total,
        "CALCULATED",
        f"{handles} handles (the Python thread, the autograd thread) x {format_size(each)} per (handle, stream)"
        + (" + hipBLASLt's own" if stack.rocm is not None else "; cuBLASLt shares it"),
        cat.source(tuple(c["sources"])),
        "INSIDE the caching allocator (counted in memory_allocated and memory_reserved): never add it here",
        inside_allocator=True,
    )


def estimate(stack: Stack, catalogue: Catalogue | None = None) -> Estimate:
    """The per-rank figure outside the caching allocator for ``stack``, with its parts."""
    cat = catalogue or load()
    arch, link = _arch_link(stack, cat)
    parts = [_context(stack, arch, cat), _lazy_modules(stack, cat), _nccl(stack, arch, link, cat)]
    paged = _paged(stack, cat)
    if paged is not None:
        parts.append(paged)
    parts.append(_cublas(arch, stack, cat))
    return Estimate(stack, arch, tuple(parts))


# -- the document ---------------------------------------------------------------------------------------------------


def stack_of(doc: Any) -> Stack:
    """The declared stack of a document (``config.read(doc).runtime``; the optimizer for paged state)."""
    from ledgerspec.contract import config

    c = config.read(doc)
    rt = c.runtime
    spec = c.optimizer.spec
    paged = bool(spec is not None and getattr(spec, "paged", False)) or "paged" in (c.optimizer.name or "").lower()
    return Stack(
        gpu_name=rt.gpu_name,
        cuda=rt.cuda,
        rocm=rt.rocm,
        torch=rt.torch,
        module_loading=rt.module_loading,
        world_size=rt.world_size,
        nccl=NcclSettings(
            rt.nccl.version,
            rt.nccl.buffsize,
            rt.nccl.channels,
            rt.nccl.nvls_enable,
            rt.nccl.runtime_connect,
            rt.nccl.communicators,
        ),
        paged=paged,
        paged_state=doc.get("ledger", "optimizer").size() if paged else None,
    )


@dataclass(frozen=True)
class Figure:
    """The per-rank bytes outside the allocator a verdict should use, and where they come from."""

    bytes: int
    source: str  # MEASURED | CALCULATED | ASSUMPTION | ...
    method: str
    estimate: Estimate | None = None  # the catalogue's, when the ledger holds no figure
    #: of ``bytes``: colocated vLLM's share of the card (``target.vllm_share_of``), 0 when there is none
    vllm: int = 0
    #: why what the ledger holds in ``outside_allocator`` is not used here ("": it is, or it holds nothing)
    elsewhere: str = ""


#: the catalogue's parts each part of ``outside_allocator`` a ledger may hold (``contract.fields.OUTSIDE_PARTS``)
#: replaces (``other``: the modules loaded at their first use, handles, resident unified memory)
DECLARED_PARTS = {"context": ("context",), "nccl": ("nccl",), "other": ("other", "unified memory")}


def with_declared(est: Estimate, doc: Any) -> Estimate:
    """``est`` with each part the ledger holds (``outside_allocator.context``, ``nccl``, ``other``: MEASURED, or the
    user's own figure) in place of the catalogue's parts it names (:data:`DECLARED_PARTS`): that part's figure
    exactly, no range; the parts it does not hold stay the catalogue's, with theirs."""
    parts = list(est.parts)
    for key, names in DECLARED_PARTS.items():
        v = doc.get("outside_allocator", key)
        size = v.size()
        if size is None:
            continue
        at = next((i for i, p in enumerate(parts) if p.name in names), len(parts))
        parts = [p for p in parts if p.name not in names]
        why = " ".join((v.note or v.method or "").split())
        source = v.effective_source(True)
        formula = f"outside_allocator.{key} as the ledger holds it" + (f" ({why})" if why else "")
        parts.insert(min(at, len(parts)), Part(key, size, size, size, source, formula, (), declared=True))
    return replace(est, parts=tuple(parts))


def for_document(doc: Any, catalogue: Catalogue | None = None) -> Figure:
    """``outside_allocator.total`` as the ledger holds it (MEASURED, or the user's own figure), else the
    catalogue's estimate for the declared stack with the parts the ledger holds in place of its own
    (:func:`with_declared`)."""
    v = doc.get("outside_allocator", "total")
    size = v.size()
    if size is not None:
        return Figure(size, v.effective_source(True), "outside_allocator.total as the ledger holds it")
    est = with_declared(estimate(stack_of(doc), catalogue), doc)
    return Figure(est.typical, est.provenance, est.method(), est)


# -- the docs' table ------------------------------------------------------------------------------------------------

#: stacks the docs work out with the catalogue (GPU name as the device reports it, ranks, extra settings)
EXAMPLES: tuple[tuple[str, int, dict[str, Any]], ...] = (
    ("NVIDIA GeForce RTX 4090", 1, {}),
    ("NVIDIA GeForce RTX 4090", 2, {}),
    ("NVIDIA L40S", 1, {"module_loading": "EAGER"}),
    ("NVIDIA A100-SXM4-80GB", 1, {}),
    ("NVIDIA A100-SXM4-80GB", 8, {}),
    ("NVIDIA H100 80GB HBM3", 1, {}),
    ("NVIDIA H100 80GB HBM3", 8, {}),
    ("NVIDIA H100 80GB HBM3", 8, {"nccl": NcclSettings(version="2.18.3")}),
    ("NVIDIA H100 80GB HBM3", 8, {"nccl": NcclSettings(nvls_enable=False)}),
    ("NVIDIA H200", 8, {}),
    ("AMD Instinct MI300X", 8, {"rocm": "6.3"}),
)


def _mib(n: int) -> str:
    return format_size(n)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _refs(ids: tuple[str, ...] | list[str]) -> str:
    return ", ".join(f"[{i}](#src-{i})" for i in ids)


def markdown(catalogue: Catalogue | None = None) -> str:
    """The catalogue as the docs show it: every entry with its figure, range, basis and sources; worked examples;
    the sources with what was read there."""
    cat = catalogue or load()
    out = [
        "### The CUDA context and the modules loaded with it (per rank, lazy loading)",
        "",
        "| architecture | GPUs (name pattern) | typical | range | basis | sources | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    patterns = {a.arch: a.pattern for a in cat.architectures}
    for arch, r in cat.context.items():
        out.append(
            f"| {arch} | `{_cell(patterns.get(arch, '(any other)'))}` | {_mib(r.typical)} | {_mib(r.low)} to "
            f"{_mib(r.high)} | {r.basis} | {_refs(r.sources)} | {_cell(r.note)} |"
        )
    e, lz = cat.eager_modules, cat.lazy_modules
    c, n = cat.cublas, cat.nccl
    ws = c["workspace"]
    out += [
        "",
        "### The other entries",
        "",
        "| entry | where | figure | range | basis | sources | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
        f"| `CUDA_MODULE_LOADING=EAGER` | outside | +{_mib(e.typical)} on the context | {_mib(e.low)} to "
        f"{_mib(e.high)} | {e.basis} | {_refs(e.sources)} | {_cell(e.note)} |",
        f"| modules loaded during the step (`other`) | outside | {_mib(lz.typical)} | {_mib(lz.low)} to "
        f"{_mib(lz.high)} | {lz.basis} | {_refs(lz.sources)} | {_cell(lz.note)} |",
        f"| cuBLAS/cuBLASLt workspace | **inside** the allocator | {_mib(_size(ws['default'], 'ws'))} per handle and "
        f"stream ({_mib(_size(ws['sm_90'], 'ws'))} on sm_90, sm_100 and sm_120; "
        f"ROCm {_mib(_size(ws['gfx942'], 'ws'))} + "
        f"hipBLASLt {_mib(_size(c['lt_workspace_rocm'], 'lt'))}) x {c['handles']} handles | exact | {c['basis']} | "
        f"{_refs(c['sources'])} | in `memory_allocated` and `memory_reserved`: never added outside; the estimate's "
        "tensor tracking does not see it, a measurement does |",
        f"| NCCL connection (per channel) | outside | LL {_mib(int(n['ll']))} + LL128 {_mib(int(n['ll128']))} + "
        f"Simple `NCCL_BUFFSIZE` ({_mib(_size(n['simple'], 'simple'))}) | allocated in "
        f"{_mib(_size(n['granularity'], 'g'))} steps | {n['basis']} | {_refs(n['sources'])} | ring: "
        f"{n['ring_connections']} connection per channel; tree: {n['tree_connections']} more (NCCL < 2.22, or "
        "`runtime_connect: false`) |",
        f"| NCCL channels | - | NVLink {n['channels']['nvlink']['typical']}, PCIe {n['channels']['pcie']['typical']} | "
        f"NVLink {n['channels']['nvlink']['low']} to {n['channels']['nvlink']['high']}, PCIe "
        f"{n['channels']['pcie']['low']} to {n['channels']['pcie']['high']} | assumption | {_refs(n['sources'])} | "
        "declare `parallelism.nccl.channels` (NCCL's INFO log prints them) |",
        f"| NCCL NVLS (sm_90, sm_100 NVSwitch boards) | outside | channels ({n['nvls']['channels']['sm_90']} on sm_90) "
        f"x 2 x {int(n['nvls']['chunk']) // 1024} KiB x {n['nvls']['steps']} steps x heads (GPUs of the node) | "
        f"NCCL 2.17 to 2.21: (buffsize + {n['nvls']['old_mem']}) per buffer | {n['basis']} | {_refs(n['sources'])} | "
        "off with `parallelism.nccl.nvls_enable: false` |",
        f"| NCCL fixed per communicator | outside | {n['fixed']['typical']} | {n['fixed']['low']} to "
        f"{n['fixed']['high']} | assumption | {_refs(n['sources'])} | communicator structures, work FIFO |",
    ]
    for lib in cat.libraries:
        out.append(f"| {lib.name} | {lib.where} | - | - | source | {_refs(lib.sources)} | {_cell(lib.note)} |")
    out += [
        "",
        "### Worked out for common stacks (per rank)",
        "",
        "| GPU | ranks | settings | context | other | NCCL | outside (typical) | range | provenance |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, world, extra in EXAMPLES:
        est = estimate(Stack(gpu_name=name, world_size=world, **extra), cat)
        settings = ", ".join(f"{k}={v}" if not isinstance(v, NcclSettings) else _nccl_text(v) for k, v in extra.items())
        got = {p.name: p for p in est.counted}
        out.append(
            f"| {name} ({est.arch}) | {world} | {settings or 'defaults'} | {_mib(got['context'].typical)} | "
            f"{_mib(got['other'].typical)} | {_mib(got['nccl'].typical)} | **{_mib(est.typical)}** | "
            f"{_mib(est.low)} to {_mib(est.high)} | {est.provenance} |"
        )
    out += ["", "### Sources", ""]
    for src in cat.sources.values():
        out.append(f'- <a id="src-{src.id}"></a>**{src.id}**: <{src.url}>: {_cell(src.what)}')
    return "\n".join(out) + "\n"


def _nccl_text(s: NcclSettings) -> str:
    names = ("version", "buffsize", "channels", "nvls_enable", "runtime_connect", "communicators")
    return ", ".join(f"nccl.{k}={getattr(s, k)}" for k in names if getattr(s, k) is not None)


__all__ = [
    "BUILT_IN",
    "CATALOGUE",
    "DECLARED_PARTS",
    "Catalogue",
    "Estimate",
    "Figure",
    "NcclSettings",
    "Part",
    "Range",
    "Source",
    "Stack",
    "architecture",
    "cublas_workspaces",
    "eager_loading",
    "estimate",
    "for_document",
    "load",
    "markdown",
    "stack_of",
    "with_declared",
]

"""The catalogue of device memory outside PyTorch's caching allocator (``devices/outside.yaml``, issue 23).

Expected figures come from the published sources the catalogue cites, worked out here by hand: NCCL's buffer sizes
from its source's definitions (NVIDIA/nccl v2.30.7 ``src/init.cc``, ``src/transport/nvls.cc``), the 10 MiB NCCL
allocation of one connection from NVIDIA/nccl#1685's ``NCCL_DEBUG_SUBSYS=ALLOC`` log, the 8,519,680 B cuBLAS
workspace from pytorch/pytorch#95668 (``torch.cuda.memory_allocated`` after a Linear on an A10G), the contexts from
the per-process nvidia-smi figures of invoke-ai/InvokeAI#9413 (RTX 3090: 256 MiB), unslothai/unsloth-zoo#1053
(RTX 6000 Ada: 426 MiB) and unslothai/unsloth#8669 (B200: 612 MiB). Nothing here is a GPU measurement of ours.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ledgerspec.contract.document import from_text
from ledgerspec.derivations.devices import outside as O
from tests.support import REPO_ROOT

MiB = 2**20
#: NCCL's protocol buffers of one connection, from src/init.cc's definitions
LL = 8 * 512 * 8 * 16  # NCCL_LL_LINES_PER_THREAD x NCCL_LL_MAX_NTHREADS x NCCL_STEPS x sizeof(ncclLLFifoLine)
LL128 = 120 * 640 * 8 * 8  # NCCL_LL128_ELEMS_PER_THREAD x NCCL_LL128_MAX_NTHREADS x NCCL_STEPS x sizeof(uint64_t)
SIMPLE = 1 << 22  # DEFAULT_BUFFSIZE


def part(est: O.Estimate, name: str) -> O.Part:
    p = est.part(name)
    assert p is not None, name
    return p


def test_every_entry_names_listed_sources_with_a_url() -> None:
    cat = O.load()
    assert cat.sources and all(s.url.startswith("https://") and s.what for s in cat.sources.values())
    for arch, r in cat.context.items():
        assert r.sources and r.basis in ("measured-public", "source", "assumption"), arch
        assert r.low <= r.typical <= r.high
    for lib in cat.libraries:
        assert lib.sources and lib.where in ("inside the allocator", "unified memory", "host", "not used")


@pytest.mark.parametrize(
    ("name", "arch", "link"),
    [
        ("NVIDIA GeForce RTX 4090", "sm_89", "pcie"),
        ("NVIDIA L40S", "sm_89", "pcie"),
        ("NVIDIA RTX 6000 Ada Generation", "sm_89", "pcie"),
        ("NVIDIA GeForce RTX 3090", "sm_86", "pcie"),
        ("NVIDIA A10G", "sm_86", "pcie"),
        ("NVIDIA RTX A6000", "sm_86", "pcie"),
        ("NVIDIA A100-SXM4-80GB", "sm_80", "nvlink"),
        ("NVIDIA A100 80GB PCIe", "sm_80", "pcie"),
        ("NVIDIA H100 80GB HBM3", "sm_90", "nvlink"),
        ("NVIDIA H100 PCIe", "sm_90", "pcie"),
        ("NVIDIA H200", "sm_90", "nvlink"),
        ("NVIDIA B200", "sm_100", "nvlink"),
        ("Tesla T4", "sm_75", "pcie"),
        ("NVIDIA L4", "sm_89", "pcie"),
        ("NVIDIA GeForce RTX 5090", "sm_120", "pcie"),
        ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition", "sm_120", "pcie"),
        # the workstation cards whose numbers look like GeForce ones (a fresh-eyes review)
        ("NVIDIA RTX 5000 Ada Generation", "sm_89", "pcie"),
        ("Quadro RTX 5000", "sm_75", "pcie"),
        ("Quadro RTX 4000", "sm_75", "pcie"),
        ("NVIDIA RTX 4000 Ada Generation", "sm_89", "pcie"),
        ("NVIDIA GeForce RTX 4060 Ti", "sm_89", "pcie"),
        ("AMD Instinct MI300X", "gfx942", "nvlink"),
        ("Some Future GPU", "unknown", "pcie"),
    ],
)
def test_gpu_names_map_to_their_architecture(name: str, arch: str, link: str) -> None:
    assert O.architecture(name) == (arch, link)


def test_every_device_of_the_device_catalogue_has_an_architecture() -> None:
    from ledgerspec.derivations.devices.catalogue import load_catalogue

    for device in load_catalogue().devices:
        assert O.architecture(device.name)[0] != "unknown", device.name


def test_the_published_contexts() -> None:
    cat = O.load()
    assert {a: (cat.context[a].typical, cat.context[a].basis) for a in ("sm_86", "sm_89", "sm_100")} == {
        "sm_86": (256 * MiB, "measured-public"),
        "sm_89": (426 * MiB, "measured-public"),
        "sm_100": (612 * MiB, "measured-public"),
    }
    # no published figure for these: an assumption, never passed off as a measurement
    assert {cat.context[a].basis for a in ("sm_80", "sm_90", "gfx942", "unknown")} == {"assumption"}


def test_one_gpu_has_no_nccl_and_the_cublas_workspace_is_never_counted() -> None:
    est = O.estimate(O.Stack(gpu_name="NVIDIA A10G"))
    assert part(est, "nccl").typical == 0
    cublas = part(est, "cuBLAS workspaces")
    assert cublas.inside_allocator and not cublas.counted
    assert cublas.low == 8_519_680  # one handle: what pytorch/pytorch#95668 saw in memory_allocated
    assert cublas.typical == 2 * 8_519_680  # the Python thread's handle and the autograd thread's
    assert est.typical == sum(p.typical for p in est.parts if p.name != "cuBLAS workspaces")
    assert part(O.estimate(O.Stack(gpu_name="NVIDIA H100 80GB HBM3")), "cuBLAS workspaces").low == 32 * MiB


def test_an_nccl_connection_is_its_three_protocol_buffers() -> None:
    """Two PCIe GPUs, NCCL declared (2.27, 4 channels): 4 channels x 1 ring connection, no NVLS."""
    stack = O.Stack(gpu_name="NVIDIA GeForce RTX 4090", world_size=2, nccl=O.NcclSettings(version="2.27.5", channels=4))
    nccl = part(O.estimate(stack), "nccl")
    conn = LL + LL128 + SIMPLE
    assert conn == 9_633_792  # 9.1875 MiB
    assert nccl.typical == 4 * conn + 8 * MiB
    assert nccl.provenance == "CALCULATED"  # the formula from NCCL's source, every input declared
    # the high side rounds a connection to NCCL's 2 MiB allocations: the 10485760 B of NVIDIA/nccl#1685
    assert (nccl.high - 32 * MiB) % 10_485_760 == 0
    smaller = part(
        O.estimate(
            O.Stack(
                gpu_name="NVIDIA GeForce RTX 4090",
                world_size=2,
                nccl=O.NcclSettings(version="2.27.5", channels=4, buffsize=1 * MiB),
            )
        ),
        "nccl",
    )
    assert nccl.typical - smaller.typical == 4 * (SIMPLE - 1 * MiB)  # NCCL_BUFFSIZE is the Simple buffer


def test_nvls_on_eight_h100s_before_and_since_nccl_2_22() -> None:
    """nvls.cc: channels x 2 x buffer x nHeads; 16 channels on sm_90, one head per GPU of the node."""

    def nvls(version: str | None, enable: bool | None = None) -> int:
        settings = O.NcclSettings(version=version, channels=16, nvls_enable=enable)
        est = O.estimate(O.Stack(gpu_name="NVIDIA H100 80GB HBM3", world_size=8, nccl=settings))
        rings = 16 * (LL + LL128 + SIMPLE) * (1 if version is None or version >= "2.22" else 3)
        return part(est, "nccl").typical - rings - 8 * MiB

    assert nvls("2.27.5") == 16 * 2 * (128 * 1024 * 8) * 8 == 268_435_456  # 256 MiB per rank
    assert nvls("2.18.3") == 16 * 2 * (SIMPLE + 2 * MiB) * 8 == 1_610_612_736  # 1.5 GiB per rank
    assert nvls("2.27.5", enable=False) == 0
    assert nvls("2.16.5") == 0  # NVLS came with 2.17
    # an undeclared NCCL: 2.22 or later assumed, the older NVLS buffers in the range
    est = O.estimate(O.Stack(gpu_name="NVIDIA H100 80GB HBM3", world_size=8))
    assert part(est, "nccl").high >= 1_610_612_736 and part(est, "nccl").provenance == "ASSUMPTION"
    # PCIe H100s have no NVSwitch
    pcie = O.estimate(O.Stack(gpu_name="NVIDIA H100 PCIe", world_size=2, nccl=O.NcclSettings(version="2.27.5")))
    assert part(pcie, "nccl").typical < 64 * MiB


def test_a_published_per_communicator_figure_lies_in_the_range() -> None:
    """NVIDIA/nccl#964: 4 A100s with NVLink, an NCCL of 2023 (no runtime connect): 688 MB per process group."""
    est = O.estimate(O.Stack(gpu_name="NVIDIA A100-SXM4-80GB", world_size=4, nccl=O.NcclSettings(version="2.18.3")))
    nccl = part(est, "nccl")
    assert nccl.low <= 688 * 10**6 <= nccl.high
    two = O.estimate(O.Stack(gpu_name="NVIDIA A100-SXM4-80GB", world_size=4, nccl=O.NcclSettings(communicators=2)))
    one = O.estimate(O.Stack(gpu_name="NVIDIA A100-SXM4-80GB", world_size=4))
    assert part(two, "nccl").typical == 2 * part(one, "nccl").typical  # each communicator its own buffers


def test_two_ranks_on_an_a100_board_the_published_and_the_source_figures_lie_in_the_range() -> None:
    """The 2-GPU FSDP1 rows' stack (NCCL 2.20.5, two A100-SXM4s). Two independent figures of NCCL's bytes per rank:
    NVIDIA/nccl#964 measured 544 MB per two-rank process group on 4 A100s with NVLink (an older NCCL); NCCL 2.20.5's
    source (tag v2.20.5-1) gives 24 channels x 12 MiB = 288 MiB: with one peer the tree's connections are the
    ring's (``src/transport.cc`` 42-54 skips a connected peer), a channel's send buffer (``ncclSendMem`` 4 KiB +
    Simple 4 MiB under P2P read) and receive buffer (``ncclRecvMem`` 4 KiB + LL 512 KiB + LL128 4.6875 MiB) are each
    padded to ``CUDA_IPC_MIN`` (2 MiB; ``src/transport/p2p.cc`` 351-354, 416-419), 6 + 6 MiB; 12 NVLinks of 20 GB/s
    to the NVSwitch give 6 rings at 40 GB/s, doubled by ``ncclTopoDupChannels`` and by ``ncclTopoPostset``. They
    disagree by 256 MiB (the measured one holds more than the buffers the source allocates at init); the catalogue's
    range must hold both, and does: its typical figure lies between them."""
    stack = O.Stack(gpu_name="NVIDIA A100-SXM4-80GB", world_size=2, nccl=O.NcclSettings(version="2.20.5"))
    nccl = part(O.estimate(stack), "nccl")
    source = 24 * (6 + 6) * MiB
    measured = 544 * 10**6
    assert nccl.low <= source < nccl.typical < measured <= nccl.high


def test_module_loading() -> None:
    lazy = O.estimate(O.Stack(gpu_name="NVIDIA L40S"))
    eager = O.estimate(O.Stack(gpu_name="NVIDIA L40S", module_loading="EAGER"))
    cat = O.load()
    assert part(eager, "context").typical == part(lazy, "context").typical + cat.eager_modules.typical
    assert part(eager, "other").typical == 0  # the step's modules are already in the context
    assert O.eager_loading(O.Stack(cuda="11.6"))  # before 11.7 there is no lazy loading
    assert O.eager_loading(O.Stack(cuda="11.8", torch="1.12.1"))  # torch < 1.13 did not set LAZY
    assert not O.eager_loading(O.Stack(cuda="12.4", torch="1.12.1"))  # CUDA 12.2+: LAZY by default
    assert not O.eager_loading(O.Stack(cuda="12.8", torch="2.13.0"))


def test_the_document_the_ledger_figure_wins_over_the_catalogue() -> None:
    base = "ledgerspec: ledger/v1\nsoftware: {gpu_name: NVIDIA H100 80GB HBM3, nccl: 2.27.5}\n"
    doc = from_text(base + "parallelism: {gpu_count: 8, nccl: {channels: 16}}\n")
    fig = O.for_document(doc)
    assert fig.estimate is not None and fig.source == "ASSUMPTION"  # the context is an assumption
    assert part(fig.estimate, "nccl").provenance == "CALCULATED"
    assert fig.bytes == fig.estimate.typical
    measured = from_text(base + "outside_allocator: {total: {value: 1 GiB, source: MEASURED, method: m}}\n")
    got = O.for_document(measured)
    assert (got.bytes, got.source, got.estimate) == (2**30, "MEASURED", None)


def test_each_part_the_ledger_holds_replaces_the_catalogue_s() -> None:
    """The docs' example (``docs/outside-allocator.md``): eight H100s with ``outside_allocator.nccl`` declared. The
    figure is the declared NCCL bytes, exactly, beside the catalogue's context and lazily loaded modules with their
    ranges (read here from ``outside.yaml`` itself); ``total``, when held, would replace the whole."""
    import yaml

    raw = yaml.safe_load(O.CATALOGUE.read_text(encoding="utf-8"))
    ctx, lazy = raw["context"]["sm_90"], raw["lazy_modules"]
    from ledgerspec.contract.units import parse_size as size

    head = "ledgerspec: ledger/v1\nsoftware: {gpu_name: NVIDIA H100 80GB HBM3}\nparallelism: {gpu_count: 8}\n"
    doc = from_text(head + "outside_allocator:\n  nccl: {value: 420 MiB, source: ASSUMPTION, note: our NCCL log}\n")
    fig = O.for_document(doc)
    assert fig.estimate is not None and fig.source == "ASSUMPTION"
    nccl = part(fig.estimate, "nccl")
    assert (nccl.typical, nccl.low, nccl.high, nccl.provenance) == (420 * MiB, 420 * MiB, 420 * MiB, "ASSUMPTION")
    assert fig.bytes == size(ctx["typical"]) + size(lazy["typical"]) + 420 * MiB
    assert fig.estimate.low == size(ctx["low"]) + size(lazy["low"]) + 420 * MiB
    assert fig.estimate.high == size(ctx["high"]) + size(lazy["high"]) + 420 * MiB
    assert "nccl 420.00 MiB (the ledger's)" in fig.method and "our NCCL log" in nccl.formula
    # every part held, measured: the figure is their sum, MEASURED, with no range (never at the edge)
    parts = (("context", 500), ("nccl", 300), ("other", 200))
    held = "".join(f"  {k}: {{value: {v} MiB, source: MEASURED, method: m}}\n" for k, v in parts)
    fig = O.for_document(from_text(head + "outside_allocator:\n" + held))
    assert fig.estimate is not None and fig.source == "MEASURED"
    assert fig.bytes == fig.estimate.low == fig.estimate.high == 1000 * MiB
    verified = O.for_document(
        from_text(
            head
            + "outside_allocator:\n"
            + held.replace("nccl: {value: 300 MiB, source: MEASURED", "nccl: {value: 300 MiB, source: VERIFIED")
        )
    )
    assert verified.source == "VERIFIED"  # the weakest part's
    from ledgerspec.derivations.devices.target import high_of, outside_of, target_of

    doc = from_text(head + "outside_allocator:\n" + held)
    target = target_of(doc, 80 * 2**30)
    assert outside_of(doc, target).bytes == high_of(outside_of(doc, target)) == 1000 * MiB


def test_the_parts_replaced_are_the_outside_allocator_fields_the_ladder_checks() -> None:
    from ledgerspec.contract import fields as F

    assert tuple(O.DECLARED_PARTS) == F.OUTSIDE_PARTS
    assert set(F.OUTSIDE_PARTS) <= {c.name for c in F.OUTSIDE_ALLOCATOR.children}


def test_the_ledger_s_other_replaces_resident_unified_memory_too() -> None:
    """``other`` is "everything else outside the allocator": the modules loaded at their first use and a paged
    optimizer's resident pages; held, it replaces both catalogue parts."""
    head = "ledgerspec: ledger/v1\nsoftware: {gpu_name: NVIDIA A100-SXM4-80GB}\noptimizer: {name: paged_adamw_8bit}\n"
    state = "ledger: {optimizer: {value: 3 GiB, source: CALCULATED, method: m}}\n"
    fig = O.for_document(from_text(head + state + "outside_allocator: {other: {value: 1 GiB, source: MEASURED}}\n"))
    assert fig.estimate is not None and fig.estimate.part("unified memory") is None
    assert part(fig.estimate, "other").high == 2**30 == part(fig.estimate, "other").typical


def test_a_paged_optimizer_adds_unified_memory_up_to_its_state() -> None:
    doc = from_text(
        "ledgerspec: ledger/v1\nsoftware: {gpu_name: NVIDIA A100-SXM4-80GB}\noptimizer: {name: paged_adamw_8bit}\n"
        "ledger: {optimizer: {value: 3 GiB, source: CALCULATED, method: m}}\n"
    )
    est = O.estimate(O.stack_of(doc))
    um = part(est, "unified memory")
    assert (um.typical, um.high) == (0, 3 * 2**30)
    plain = O.estimate(O.stack_of(from_text("ledgerspec: ledger/v1\noptimizer: {name: adamw_torch}\n")))
    assert plain.part("unified memory") is None


def test_the_docs_page_renders_the_catalogue() -> None:
    page = (REPO_ROOT / "docs" / "outside-allocator.md").read_text(encoding="utf-8")
    assert "<!-- ledgerspec:outside -->" in page
    assert "outside-allocator.md" in (REPO_ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    text = O.markdown()
    cat = O.load()
    for arch in cat.context:
        assert f"| {arch} |" in text
    for src in cat.sources.values():
        assert f'id="src-{src.id}"' in text and src.url in text
    for name, _, _ in O.EXAMPLES:
        assert name in text


def test_the_catalogue_ships_beside_the_module() -> None:
    assert Path(O.CATALOGUE).name == "outside.yaml" and Path(O.CATALOGUE).is_file()


def test_a_paged_state_the_ledger_lacks_is_taken_from_the_estimate() -> None:
    """An intake has no ``ledger.optimizer``, a sweep's variant over ``optimizer=`` or ``rank=`` another
    configuration's: the verdict's high end takes the paged state from the estimate it is computed with
    (``stated``), as the resolved ledger holds it; the typical figure (0 resident) does not move; a declared figure
    or an optimizer without paged state is kept as it is."""
    from ledgerspec.derivations.devices.target import high_of, outside_of, stated, target_of

    head = "ledgerspec: ledger/v1\nsoftware: {gpu_name: NVIDIA A100-SXM4-80GB}\noptimizer: {name: paged_adamw_8bit}\n"
    resolved = from_text(head + "ledger: {optimizer: {value: 3 GiB, source: CALCULATED, method: m}}\n")
    intake = from_text(head)
    target = target_of(intake, 80 * 2**30)
    taken = stated(intake, target, outside_of(intake, target), 3 * 2**30)
    want = outside_of(resolved, target)
    high, without = high_of(want), high_of(outside_of(intake, target))
    assert high is not None and without is not None
    assert high_of(taken) == high > without
    assert taken.bytes == want.bytes == outside_of(intake, target).bytes
    variant = stated(resolved, target, want, 2**30)  # another configuration's state than the ledger's
    assert high_of(variant) == high - 2 * 2**30
    plain = from_text("ledgerspec: ledger/v1\noptimizer: {name: adamw_torch}\n")
    assert stated(plain, target, outside_of(plain, target), 3 * 2**30) == outside_of(plain, target)
    declared = from_text(head + "outside_allocator: {total: {value: 1 GiB, source: MEASURED, method: m}}\n")
    assert stated(declared, target, outside_of(declared, target), 3 * 2**30).estimate is None


@pytest.mark.slow  # the tiny model's step on the device, twice
def test_an_intake_and_its_resolved_ledger_get_the_same_high_end(tmp_path: Path) -> None:
    """The verdict on the device of a paged optimizer's step: with ``ledger.optimizer`` as ``resolve`` writes it
    (the estimate's optimizer component) and without it, the replay is checked against the same high end."""
    pytest.importorskip("torch")
    import shutil

    from ledgerspec.derivations.devices.prediction import estimate_on_device
    from ledgerspec.derivations.devices.target import high_of, outside_of
    from tests.support.estimate_docs import DATA, ledger_text

    shutil.copytree(DATA / "tiny-llama-gqa", tmp_path / "tiny-llama-gqa")
    text = ledger_text(optimizer="paged_adamw_8bit")
    intake = from_text(text, str(tmp_path / "t.ledger.yaml"))
    est, p = estimate_on_device(intake, 2**30)
    state = est.components["optimizer"]
    assert state > 0
    resolved = from_text(
        text + f"ledger:\n  optimizer: {{value: {state}, source: CALCULATED, method: m}}\n",
        str(tmp_path / "t.ledger.yaml"),
    )
    _, q = estimate_on_device(resolved, 2**30)
    assert p.replayed.outside_high == q.replayed.outside_high == high_of(outside_of(resolved, q.target))
    assert p.outside_text() == q.outside_text()

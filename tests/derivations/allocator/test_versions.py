"""The declared torch's caching allocator against the model's (torch 2.13's): what was compared, and the settings
under which a compared version differs. The comparison itself (torch 2.2.1's ``CUDACachingAllocator.cpp``, matched
to the 2.2.1 wheel's assertion line numbers) is recorded in :mod:`ledgerspec.derivations.allocator.versions`; these
tests hold what the notes say to it."""

from __future__ import annotations

import pytest

from ledgerspec.derivations.allocator.versions import COMPARED, MODELLED, minor, settings_of, version_note


@pytest.mark.parametrize("torch", [None, "", "2.13.0", "2.13.0+cu130", "2.13"])
def test_the_modelled_version_or_none_needs_no_note(torch: str | None) -> None:
    assert version_note(torch) == ""


def test_torch_2_2_follows_the_model_under_the_defaults_and_says_where_it_differs() -> None:
    assert minor("2.2.1+cu121") == "2.2" and MODELLED == "2.13"
    same = version_note("2.2.1")
    assert same == "torch 2.2.1's allocator follows the rules modelled under PyTorch's defaults (compared line by line)"
    assert "follows the rules modelled under these settings" in version_note("2.2.0", "expandable_segments:True")
    split = version_note("2.2.1", "expandable_segments:True,max_split_size_mb:20")
    assert split.startswith("torch 2.2.1's allocator differs from the model's with these settings (max_split_size_mb:")
    assert "a value of 20 is refused" in split
    assert "unrounded" in version_note("2.2.1", "roundup_power2_divisions:1")
    assert "not an option of torch 2.2" in version_note("2.2.1", "max_non_split_rounding_mb:64")
    # a setting that torch 2.2 treats as the model does is no difference
    for same in ("roundup_power2_divisions:4", "max_split_size_mb:128", "garbage_collection_threshold:0.6"):
        assert "follows the rules modelled under these settings" in version_note("2.2.1", same), same
    assert "internal assert" in version_note("2.2.1", "expandable_segments:True,garbage_collection_threshold:0.6")
    assert settings_of(" expandable_segments:True , max_split_size_mb:128") == {
        "expandable_segments": "True",
        "max_split_size_mb": "128",
    }


def test_a_version_not_compared_says_so() -> None:
    note = version_note("2.5.1")
    assert (
        note == "the declared torch 2.5.1's allocator was not compared with the model (compared: 2.2.1, and 2.13, "
        "which it follows)"
    )
    assert set(COMPARED) == {"2.2"}


def test_the_estimate_says_it_for_the_declared_torch() -> None:
    from ledgerspec.contract.document import from_text
    from ledgerspec.derivations.devices.prediction import allocator_note

    doc = from_text(
        "ledgerspec: ledger/v1\nsoftware: {torch: 2.2.1, pytorch_cuda_alloc_conf: 'max_split_size_mb:20'}\n"
    )
    assert "a value of 20 is refused" in allocator_note(doc)

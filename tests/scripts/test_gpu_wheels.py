"""``scripts/gpu-wheels``: the cp312 wheels the GPU machine lacks, downloaded with the device README's flags."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.support import REPO_ROOT, load_script

# -- scripts/gpu-wheels ------------------------------------------------------------------------------------------------

WHEELS_SCRIPT = REPO_ROOT / "scripts" / "gpu-wheels"


def _wheels_script() -> Any:
    return load_script(WHEELS_SCRIPT, "gpu_wheels_under_test")


def _wheel(folder: Path, filename: str, requires: list[str], size: int = 0) -> Path:
    import zipfile

    dist, version = filename.split("-")[:2]
    path = folder / filename
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(
            f"{dist}-{version}.dist-info/METADATA",
            "Metadata-Version: 2.1\nName: x\n" + "".join(f"Requires-Dist: {r}\n" for r in requires),
        )
        z.writestr("pad.bin", b"\0" * size)
    return path


def test_gpu_wheels_downloads_with_the_device_readme_flags() -> None:
    mod = _wheels_script()
    cmd = mod.download_command("bitsandbytes", "0.50.2", Path("/r/.whl"), "3.12")
    assert cmd[1:] == [
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        "--platform",
        "manylinux_2_28_x86_64",
        "--platform",
        "manylinux_2_27_x86_64",
        "--platform",
        "manylinux_2_24_x86_64",
        "--platform",
        "manylinux_2_17_x86_64",
        "--platform",
        "manylinux2014_x86_64",
        "--platform",
        "manylinux1_x86_64",
        "-d",
        "/r/.whl",
        "bitsandbytes==0.50.2",
    ]
    assert set(mod.WANTED) == {
        "ruamel.yaml",
        "jsonschema",
        "referencing",
        "jsonschema-specifications",
        "rpds-py",
        "bitsandbytes",
    }


@pytest.mark.parametrize(
    ("python", "expected"), [("3.12", ["attrs", "rpds-py", "typing-extensions"]), ("3.13", ["attrs", "rpds-py"])]
)
def test_gpu_wheels_reads_requirements_with_markers_for_the_device_python(python: str, expected: list[str]) -> None:
    mod = _wheels_script()
    meta = (
        "Name: referencing\nRequires-Dist: attrs>=22.2.0\nRequires-Dist: rpds-py>=0.7.0\n"
        "Requires-Dist: typing-extensions>=4.4.0; python_version < '3.13'\n"
        "Requires-Dist: pytest; extra == 'test'\n"
    )
    assert mod.requirements(meta, python) == expected


def test_gpu_wheels_flags_a_requirement_neither_carried_nor_on_the_device(tmp_path: Path) -> None:
    mod = _wheels_script()
    ok = [
        _wheel(tmp_path, "jsonschema-4.26.0-py3-none-any.whl", ["attrs>=22", "referencing>=0.28", "rpds-py"]),
        _wheel(tmp_path, "referencing-0.37.0-py3-none-any.whl", ["attrs", "rpds_py>=0.7"]),
        _wheel(tmp_path, "rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.whl", []),
    ]
    assert mod.missing_requirements(ok, "3.12") == []  # attrs is on the device, the rest travels
    bad = [*ok, _wheel(tmp_path, "ruamel_yaml-0.19.1-py3-none-any.whl", ["ruamel.yaml.clib>=0.2.7"])]
    assert mod.missing_requirements(bad, "3.12") == [
        "ruamel-yaml-clib (required by ruamel_yaml-0.19.1-py3-none-any.whl)"
    ]


def test_gpu_wheels_keeps_one_version_of_each_for_the_device_python() -> None:
    mod = _wheels_script()
    names = [
        "rpds_py-2026.9.1-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
        "rpds_py-2026.9.1-cp311-cp311-manylinux_2_17_x86_64.whl",  # another Python
        "jsonschema-4.25.0-py3-none-any.whl",  # another version
        "jsonschema-4.26.0-py3-none-any.whl",
        "six-1.17.0-py2.py3-none-any.whl",
    ]  # not wanted
    keep, stale = mod.split_stale([Path(n) for n in names], mod.WANTED, "3.12")
    assert [p.name for p in keep] == [names[0], names[3]]
    assert [p.name for p in stale] == [names[1], names[2], names[4]]


def test_gpu_wheels_drops_only_bitsandbytes_when_the_limit_is_passed(tmp_path: Path) -> None:
    mod = _wheels_script()
    small = _wheel(tmp_path, "jsonschema-4.26.0-py3-none-any.whl", [], 1000)
    big = _wheel(tmp_path, "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl", [], 50_000)
    sizes = small.stat().st_size, big.stat().st_size
    assert mod.fit(0, [small, big], limit=sum(sizes)) == ([small, big], [])
    kept, notes = mod.fit(0, [small, big], limit=sum(sizes) - 1)
    assert kept == [small] and "dropped" in notes[0] and big.name in notes[0]
    with pytest.raises(SystemExit):
        mod.fit(sizes[1], [small, big], limit=sum(sizes) - 1)  # too big even without bitsandbytes

"""identity.model_id + revision: the config comes through transformers' own loading from the local Hugging Face
cache (here a cache laid out by the test, as huggingface_hub lays it out), and --offline never asks the network."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import EXAMPLES

REV = "01c7f73d771dfac7d292323805ebc428287df4f9"
INTAKE = """ledgerspec: intake/v1
identity:
  model_id: {model_id}   # no config_path: transformers loads it
  revision: {rev}
method: {{kind: LoRA, rank: 8, target_modules: [q_proj, v_proj]}}
base_model: {{loaded_dtype: bfloat16}}
adapter: {{dtype: float32}}
workload: {{microbatch: 1, max_length: 512, sequence_p95: 400, packing: false}}
optimizer: {{name: adamw_torch}}
memory_options: {{gradient_checkpointing: true}}
"""


def _cache(root: Path) -> Path:
    repo = root / "hub" / "models--meta-llama--Llama-2-7b-hf"
    (repo / "snapshots" / REV).mkdir(parents=True)
    (repo / "refs").mkdir()
    shutil.copy(EXAMPLES / "configs" / "llama-2-7b" / "config.json", repo / "snapshots" / REV / "config.json")
    (repo / "refs" / "main").write_text(REV)
    return root / "hub"


def _resolve(
    tmp_path: Path, model_id: str, *flags: str, endpoint: str | None = None
) -> subprocess.CompletedProcess[str]:
    intake = tmp_path / "x.intake.yaml"
    intake.write_text(INTAKE.format(model_id=model_id, rev=REV))
    env = {**os.environ, "HF_HUB_CACHE": str(_cache(tmp_path)), "HF_HOME": str(tmp_path / "home")}
    env.pop("HF_HUB_OFFLINE", None)
    if endpoint is not None:
        env["HF_ENDPOINT"] = endpoint
    return subprocess.run(
        [sys.executable, "-m", "ledgerspec", "resolve", str(intake), "-o", str(tmp_path / "x.ledger.yaml"), *flags],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.slow
def test_model_id_and_revision_resolve_from_the_local_cache(tmp_path: Path) -> None:
    proc = _resolve(tmp_path, "meta-llama/Llama-2-7b-hf", "--offline")
    assert proc.returncode == 0, proc.stderr
    from ledgerspec.contract.document import load

    doc = load(str(tmp_path / "x.ledger.yaml"))
    config = json.loads((EXAMPLES / "configs" / "llama-2-7b" / "config.json").read_text())
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    assert doc.get("identity", "architecture").text() == "LlamaForCausalLM"
    assert doc.get("method", "trainable_parameters").value == layers * 2 * 8 * (h + h)  # r(d_in + d_out), q and v
    assert "# no config_path: transformers loads it" in (tmp_path / "x.ledger.yaml").read_text()


@pytest.mark.slow
def test_offline_model_missing_from_the_cache_is_one_clear_line(tmp_path: Path) -> None:
    proc = _resolve(tmp_path, "nobody/nothing", "--offline")
    assert proc.returncode == 1
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "kernels" not in ln]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{tmp_path / 'x.intake.yaml'}:3:")
    assert "cannot load the config of 'nobody/nothing'" in lines[0] and "Traceback" not in proc.stderr
    # not transformers' "We couldn't connect to 'https://huggingface.co'": --offline asked nothing of it
    assert "not in the local Hugging Face cache, and --offline asks nothing of the Hub" in lines[0]
    assert "Retrying" not in proc.stderr  # --offline: no network attempts
    assert not (tmp_path / "x.ledger.yaml").exists()


#: a host name that never resolves (RFC 2606 reserves .invalid): the Hub cannot be reached at all
NO_HUB = "https://hub.ledgerspec.invalid"


@pytest.mark.slow
@pytest.mark.parametrize(("model_id", "ok"), [("meta-llama/Llama-2-7b-hf", True), ("nobody/nothing", False)])
def test_without_a_way_to_the_hub_only_the_cache_is_asked(tmp_path: Path, model_id: str, ok: bool) -> None:
    """No --offline, but the Hub's name does not resolve: no half minute of retries, the cache answers or one line."""
    proc = _resolve(tmp_path, model_id, endpoint=NO_HUB)
    assert "Retrying" not in proc.stderr and "Traceback" not in proc.stderr
    if ok:
        assert proc.returncode == 0, proc.stderr
    else:
        lines = [ln for ln in proc.stderr.splitlines() if ln.strip() and "kernels" not in ln]
        assert proc.returncode == 1 and len(lines) == 1, proc.stderr
        assert "the Hub (hub.ledgerspec.invalid) cannot be reached" in lines[0]
        assert "not in the local Hugging Face cache" in lines[0]

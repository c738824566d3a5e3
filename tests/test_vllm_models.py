"""Every model family through the connector, in real vLLM engines (CPU) on real kvfs mounts.

Tiny configs (tests/data/models/<family>/config.json) with the SmolLM2 tokenizer and vLLM's seeded dummy
weights (load_format "dummy": every process builds the same weights). Per family, three engines, each in its
own process: a plain one (no connector), engine 1 that stores, and a fresh engine 2 that loads. Each runs a
first turn of two prompts longer than any sliding window, then a second turn that extends the first prompt
with its answer. Checked: engine 2 loads (cached tokens > 0), every engine's greedy tokens equal the plain
engine's, and every block engine 2 loaded is byte-equal to the file engine 1 stored (the connector subclass
in tests/kvfs_verify_connector.py compares them inside the engine). Sliding-window parts must read only their
window. Needs tools/install_vllm.sh (CI runs it).
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import REPO, KvfsMount
from test_vllm import MODEL, TEXTS, _require_vllm

sys.path.insert(0, str(REPO / "tools"))
import vllm_driver
from model_families import FAMILIES, fp8_unavailable, model_dir

pytestmark = pytest.mark.slow

FIRST_TURN = {"max_tokens": 8, "concurrency": 1}


@pytest.fixture(scope="module")
def tokens():
    _require_vllm()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    return [tok(Path(t).read_text(errors="replace"))["input_ids"] for t in TEXTS]


def engine(tmp: Path, model: Path, rounds: list[dict], mount: Path | None, **job) -> dict:
    conn = None
    if mount is not None:
        conn = {"kv_connector": "VerifyingConnector", "kv_connector_module_path": "kvfs_verify_connector",
                "kv_connector_extra_config": {"mount": str(mount)}}
    job = {"model": str(model), "connector": conn, "rounds": rounds, "max_model_len": 4096,
           "dtype": vllm_driver.engine_dtype(), "max_num_batched_tokens": 256, "in_process": True,
           "load_format": "dummy", **job}
    tmp.mkdir(parents=True, exist_ok=True)
    verify = tmp / "verify"
    verify.mkdir(exist_ok=True)
    logfile = tmp / f"engine-{len(list(tmp.glob('engine-*.log')))}.log"
    env = {"PYTHONHASHSEED": "0", "KVFS_VERIFY_DIR": str(verify),
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    try:
        result = vllm_driver.spawn(job, logfile, 420, env=env)
    except vllm_driver.EngineFailed as e:
        pytest.fail(str(e))
    errors = [line for line in result["log"].splitlines() if "kvfs_connector" in line and " ERROR " in line]
    assert not errors, errors
    checks = [json.loads(Path(f).read_text()) for f in glob.glob(str(verify / "*.json"))]
    result["verify"] = {k: sum(c[k] for c in checks) for k in ("verified", "mismatched", "loads")}
    result["verify"]["parts"] = {}
    for c in checks:
        for kind, n in c["parts"].items():
            result["verify"]["parts"][kind] = result["verify"]["parts"].get(kind, 0) + n
    shutil.rmtree(verify)
    return result


def outputs(result: dict, rnd: int) -> list[list[int]]:
    return [r["tokens"] for r in result["rounds"][rnd]]


def cached(result: dict, rnd: int) -> list[int]:
    return [r["num_cached_tokens"] for r in result["rounds"][rnd]]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_fresh_engine_loads_what_another_stored(family, tokens, tmp_path_factory):
    fam = FAMILIES[family]
    options, kinds = fam.options, list(fam.parts)
    if options.get("kv_cache_dtype", "").startswith("fp8") and (why := fp8_unavailable()):
        pytest.skip(why)  # a hardware condition, like a GPU
    tmp = tmp_path_factory.mktemp(family)
    model = model_dir(tmp, fam)
    first = [tokens[0][:700], tokens[1][:1100]]
    rounds = [{"prompts": first, **FIRST_TURN},
              {"prompts": [{"extend": [0, 0], "extra": tokens[2][:150]}], "max_tokens": 8}]
    plain = engine(tmp / "plain", model, rounds, None, **options)
    m = KvfsMount(tmp, "mount")
    m.start()
    try:
        one = engine(tmp / "e1", model, rounds[:1], m.mountpoint, **options)
        assert "kvfs connector" in one["log"] and "Turning off hybrid kv cache manager" not in one["log"]
        for kind in kinds:
            name = "recurrent state" if kind == "state" else f"{kind} attention"
            assert name in one["log"], (kind, one["log"][-3000:])
        stored = sorted(m.mountpoint.glob("*/*/*.kv"))
        assert stored and cached(one, 0) == [0, 0]
        two = engine(tmp / "e2", model, rounds, m.mountpoint, **options)
    finally:
        assert m.stop() == 0
    assert outputs(one, 0) == outputs(plain, 0)
    assert outputs(two, 0) == outputs(plain, 0) and outputs(two, 1) == outputs(plain, 1)
    hits = cached(two, 0)
    assert all(h >= 256 for h in hits), hits
    assert cached(two, 1)[0] >= hits[0]  # the second turn reuses the first turn's chunks
    v = two["verify"]
    assert v["mismatched"] == 0 and v["verified"] > 0 and v["loads"] > 0, v
    assert set(v["parts"]) == set(kinds), v
    if "window" in kinds:  # a window part loads its window: one 128-token block per hit, not the history
        assert v["parts"]["window"] < v["parts"]["full"] / 2, v
    assert not m.unexpected_log_lines(), m.unexpected_log_lines()

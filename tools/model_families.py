"""The model families the connector serves, as tiny dummy-weight vLLM engines: what the engine tests
(tests/test_vllm_models.py) and the benchmark (tools/bench_models.py) share.

A family is a tiny config in tests/data/models/<config>/config.json, run with the SmolLM2 tokenizer and vLLM's
seeded dummy weights (load_format "dummy": every process builds the same weights), plus engine options.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CONFIGS = REPO / "tests" / "data" / "models"
TOKENIZER = REPO / ".venv" / "opt" / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Family:
    name: str
    config: str  # directory under tests/data/models
    attention: str  # what the model's layers do, for tables
    parts: tuple[str, ...]  # the connector's parts (model.Part.kind)
    options: dict = field(default_factory=dict)  # engine options (tools/vllm_driver.py job keys)
    window: int | None = None


FAMILIES = {f.name: f for f in (
    Family("gqa", "gqa", "full attention, GQA (Qwen3)", ("full",)),
    Family("mla", "mla", "MLA (DeepSeek-V2/V3), AMX_MLA or CPU_MLA", ("mla",)),
    Family("gemma3", "gemma3", "5 sliding-window (128) : 1 full (Gemma 3)", ("full", "window"), window=128),
    Family("gptoss", "gptoss", "sliding window (128) + sinks : full (gpt-oss)", ("full", "window"), window=128),
    Family("fp8", "gqa", "full attention, fp8 e4m3 KV", ("full",), {"kv_cache_dtype": "fp8_e4m3"}),
    Family("granite-h", "hybrid", "Mamba2 : attention (Granite-4-H)", ("full", "state"),
           {"prefix_caching": True, "mamba_cache_mode": "align"}),
    Family("qwen3-next", "qwen3next", "Gated DeltaNet : attention (Qwen3-Next)", ("full", "state"),
           {"prefix_caching": True, "mamba_cache_mode": "align"}),
)}


def model_dir(tmp: Path, family: Family) -> Path:
    """A model directory of the family's tiny config and the SmolLM2 tokenizer (no weights: dummy)."""
    out = tmp / f"model-{family.config}"
    if not out.exists():
        out.mkdir(parents=True)
        shutil.copy(CONFIGS / family.config / "config.json", out / "config.json")
        for name in TOKENIZER_FILES:
            if (TOKENIZER / name).exists():
                shutil.copy(TOKENIZER / name, out / name)
    return out


def fp8_unavailable() -> str | None:
    """Why vLLM's CPU kernels cannot run fp8 KV on this machine (they need AVX-512 or AMX), or None."""
    import torch
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    if not current_platform.is_cpu():
        return None
    try:
        _get_attn_isa(torch.bfloat16, 128, 64, "fp8_e4m3")
    except NotImplementedError as e:
        return str(e)
    return None

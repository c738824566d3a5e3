#!/usr/bin/env python3
"""Run one vLLM engine (CPU) over a batch of requests and report tokens, external hits and TTFT as JSON.

Used by the tests (one engine per process, like production) and by tools/bench_ttft.py. Input: a JSON job on
stdin or in a file:

    {"model": DIR, "connector": null | {"kv_connector": ..., "kv_connector_module_path": ...,
                                        "kv_connector_extra_config": {...}},
     "rounds": [ {"prompts": [[token ids], ...], "max_tokens": 8, "concurrency": 8}, ... ],
     "max_model_len": 8192, "kv_cache_gib": 1, "block_size": null, "dtype": null,
     "num_gpu_blocks_override": null, "atomic_groups": false, "kv_events_endpoint": null, "in_process": false,
     "load_format": null, "attention_backend": null, "mamba_cache_mode": null}

"in_process" runs the engine core and its one worker in this process (vLLM's "uni" executor, no engine-core
process), with as many OpenMP threads as vLLM gives its worker process (the CPUs less the reserved ones): the
same arithmetic and tokens, and about 20 s less start-up on 2 cores. Left to itself it would run 2 threads
where the worker runs 1, and greedy decoding then picked other tokens. The default is vLLM's production
layout: a scheduler process and a worker process, each with its half of the connector.

dtype null means engine_dtype(): bfloat16 where the CPU computes it natively, float32 elsewhere.

A round may name a "wait_file" (the round starts once that file exists) and a "done_file" (touched when the
round is over): another process paces the engine round by round (tools/bench_lmcache_l2.py).

A prompt may also be {"extend": [round, index], "extra": [token ids]}: the prompt of that earlier request,
then its generated tokens, then `extra` — the next turn of a conversation. {"tokens": [token ids], "cache_salt":
"..."} sends the tokens with vLLM's cache_salt (the tenant's salt). Each round submits its prompts `concurrency` at a time (all of a group at once, the next group after the
previous one finished; with "atomic_groups" the scheduler is paused while a group is added, so that its
first step sees the whole group instead of the requests that reached the engine core first) through
LLMEngine.step(), greedy, and records per request: the generated token ids,
num_cached_tokens (vLLM's count of prompt tokens it did not compute: local prefix cache + connector hits),
TTFT (from submission to the step that produced the first token) and end-to-end latency. A round with
"prompt_logprobs": K also records, per computed prompt position, [logprob of the prompt token, top-1 token]. Output: one JSON
object on stdout's last line: {"rounds": [[{...per request...}]], "engine_start_s": ...}.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


NATIVE_BF16_FLAGS = {"avx512_bf16", "amx_bf16", "bf16"}  # x86 AVX-512/AMX, arm64 (/proc/cpuinfo names)


def engine_dtype() -> str:
    """The model dtype for engines on this CPU: $KVFS_VLLM_DTYPE, else bfloat16 where the CPU has bf16
    instructions and float32 where it has not. Without them torch emulates bf16 GEMMs about 60x slower than
    float32 (measured on an AVX2-only EPYC: 1 vs 59 GFLOP/s), which would put a 4096-token prefill at minutes."""
    forced = os.environ.get("KVFS_VLLM_DTYPE")
    if forced:
        return forced
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "bfloat16"
    flags = {f for line in text.splitlines() if line.startswith(("flags", "Features")) for f in line.split()[2:]}
    return "bfloat16" if flags & NATIVE_BF16_FLAGS else "float32"


def _env() -> None:
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def run(job: dict) -> dict:
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(job.get("kv_cache_gib", 1))
    _env()
    if job.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # read when vLLM is imported
        reserved = int(os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"])
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) - reserved)))
    from vllm import EngineArgs, LLMEngine, SamplingParams, TokensPrompt
    from vllm.config import KVTransferConfig

    t0 = time.perf_counter()
    kwargs = dict(model=job["model"], dtype=job.get("dtype") or engine_dtype(),
                  max_model_len=job.get("max_model_len", 8192), enforce_eager=True, seed=0,
                  enable_prefix_caching=job.get("prefix_caching", False),
                  max_num_batched_tokens=job.get("max_num_batched_tokens", job.get("max_model_len", 8192)))
    if job.get("in_process"):
        kwargs["distributed_executor_backend"] = "uni"
    if job.get("block_size"):
        kwargs["block_size"] = job["block_size"]
    if job.get("kv_cache_dtype"):
        kwargs["kv_cache_dtype"] = job["kv_cache_dtype"]
    for key in ("load_format", "attention_backend", "mamba_cache_mode"):  # e.g. "dummy": seeded weights
        if job.get(key):
            kwargs[key] = job[key]
    if job.get("num_gpu_blocks_override"):
        kwargs["num_gpu_blocks_override"] = job["num_gpu_blocks_override"]
    if job.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(kv_role="kv_both", **job["connector"])
    if job.get("kv_events_endpoint"):  # vLLM's own KV events (its prefix cache's blocks), e.g. ipc:///tmp/ev
        from vllm.config import KVEventsConfig

        kwargs["kv_events_config"] = KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                                                    endpoint=job["kv_events_endpoint"])
    engine = LLMEngine.from_engine_args(EngineArgs(**kwargs))
    started = time.perf_counter() - t0

    results = []
    n = 0
    for rnd in job["rounds"]:
        extra = {}
        if rnd.get("prompt_logprobs") is not None:  # connector hits stay on: only computed tokens get logprobs
            extra = dict(prompt_logprobs=rnd["prompt_logprobs"], skip_reading_prefix_cache=False, detokenize=False)
        while rnd.get("wait_file") and not Path(rnd["wait_file"]).exists():
            time.sleep(0.02)
        params = SamplingParams(temperature=0.0, max_tokens=rnd.get("max_tokens", 8), ignore_eos=True, **extra)
        prompts = [_resolve(p, job["rounds"], results) for p in rnd["prompts"]]
        salts = [p.get("cache_salt") if isinstance(p, dict) else None for p in rnd["prompts"]]
        out: list[dict] = [None] * len(prompts)  # type: ignore[list-item]
        conc = rnd.get("concurrency", 1)
        for g in range(0, len(prompts), conc):
            group = list(range(g, min(g + conc, len(prompts))))
            submitted = {}
            gate = job.get("atomic_groups") and len(group) > 1
            if gate:  # the engine core would start a step with whichever requests reached it first
                engine.engine_core.call_utility("pause_scheduler", "keep", False)
            for i in group:
                rid = f"r{n}"
                n += 1
                salt = {"cache_salt": salts[i]} if salts[i] is not None else {}
                engine.add_request(rid, TokensPrompt(prompt_token_ids=prompts[i], **salt), params)
                submitted[rid] = (i, time.perf_counter())
            if gate:
                engine.engine_core.call_utility("resume_scheduler")
            first: dict[str, float] = {}
            while engine.has_unfinished_requests():
                for o in engine.step():
                    i, t_sub = submitted[o.request_id]
                    now = time.perf_counter()
                    if o.request_id not in first and o.outputs and o.outputs[0].token_ids:
                        first[o.request_id] = now - t_sub
                    if o.finished:
                        out[i] = {"tokens": list(o.outputs[0].token_ids), "prompt": prompts[i],
                                  "num_cached_tokens": o.num_cached_tokens or 0,
                                  "prompt_tokens": len(prompts[i]), "ttft_s": first.get(o.request_id),
                                  "e2e_s": now - t_sub}
                        if extra:
                            out[i]["prompt_logprobs"] = _prompt_logprobs(o.prompt_logprobs, prompts[i])
        results.append(out)
        if rnd.get("done_file"):
            Path(rnd["done_file"]).touch()
    t1 = time.perf_counter()
    del engine
    return {"rounds": results, "engine_start_s": started, "shutdown_s": time.perf_counter() - t1}


def _prompt_logprobs(entries, prompt: list[int]) -> list[list]:
    """[logprob of the prompt token, top-1 token] for the last prompt positions vLLM computed. Positions whose
    KV came from a connector have no logits: vLLM returns fewer entries, or rows that do not hold the prompt
    token; each entry is checked to hold its prompt token, and the run of checked entries at the end is kept."""
    entries = list(entries or [])
    best: list[list] = []
    for offset in {len(prompt) - len(entries), 0}:  # entries aligned to the prompt's end, or to its start
        out: list[list] = []
        for pos in range(len(prompt) - 1, max(offset, 0) - 1, -1):
            e = entries[pos - offset] if 0 <= pos - offset < len(entries) else None
            if not e or prompt[pos] not in e:
                break
            out.append([e[prompt[pos]].logprob, min(e, key=lambda k: e[k].rank)])
        if len(out) > len(best):
            best = out
    return best[::-1]


def _resolve(prompt, rounds: list, results: list) -> list[int]:
    if isinstance(prompt, dict) and "tokens" in prompt:
        return list(prompt["tokens"])
    if isinstance(prompt, dict):
        r, i = prompt["extend"]
        return results[r][i]["prompt"] + results[r][i]["tokens"] + list(prompt["extra"])
    return list(prompt)


class EngineFailed(RuntimeError):
    pass


def spawn(job: dict, logfile: Path, timeout: float = 900, env: dict | None = None) -> dict:
    """Run `job` in a new engine process (its own session: everything it starts is killed afterwards, since
    vLLM can leave engine processes behind). Returns the result plus the engine's log text under "log"."""
    jobfile = Path(logfile).with_suffix(".json")
    jobfile.write_text(json.dumps(job))
    with open(logfile, "wb") as log:
        proc = subprocess.Popen([sys.executable, __file__, str(jobfile)], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **(env or {})})
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    text = Path(logfile).read_text(errors="replace")
    # the result is the last JSON line: interpreter shutdown may print warnings after it (resource_tracker)
    last = next((line for line in reversed(text.splitlines()) if line.startswith("{")), "")
    if proc.returncode != 0 or not last:
        raise EngineFailed(f"engine failed (status {proc.returncode}), log {logfile}:\n{text[-8000:]}")
    result = json.loads(last)
    result["log"] = text
    return result


def main() -> int:
    job = json.load(open(sys.argv[1]) if len(sys.argv) > 1 else sys.stdin)
    result = run(job)
    sys.stdout.flush()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

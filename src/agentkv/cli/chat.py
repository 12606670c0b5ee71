"""``agentkv chat --agent ID``: an interactive, streaming conversation that persists."""

from __future__ import annotations

import sys

from .output import progress


def run_chat(args) -> int:
    from ..agent_id import validate_agent_id
    from ..engine import Engine
    from ..model.load import check_model_source
    from .serve import checked_engine_options, engine_format

    agent = validate_agent_id(args.agent)
    options = checked_engine_options(
        {"kv_bits": args.kv_bits, "key_bits": args.key_bits, **engine_format(args)}
    )
    if args.model is not None:
        check_model_source(args.model)
    progress("loading model...")
    with Engine(model=args.model, cache_dir=args.cache_dir, **options) as eng:
        messages = eng.history(agent) or []
        if messages:
            progress(f"resuming {agent}: {len(messages)} messages so far")
        elif args.system:
            messages = [{"role": "system", "content": args.system}]
        _converse(eng, agent, messages, args, interactive=sys.stdin.isatty())
    return 0


def _converse(eng, agent: str, messages: list[dict], args, *, interactive: bool) -> None:
    """Read a message a line until /exit or end of input, and stream each answer to stdout.
    With input piped in, no prompt or hint is printed: stdout holds the answers alone."""
    if interactive:
        progress("type a message; /exit or Ctrl-D to leave")
    while True:
        try:
            line = input("you> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if line.strip():
            messages.append({"role": "user", "content": line})
            answer = _answer(eng, agent, messages, args, interactive=interactive)
            messages.append({"role": "assistant", "content": answer})


def _answer(eng, agent: str, messages: list[dict], args, *, interactive: bool) -> str:
    """Stream one answer to stdout (after the agent's name when interactive), then its
    turn's statistics to stderr; returns its text."""
    stream = eng.stream_chat(
        agent, messages, max_tokens=args.max_tokens, temperature=args.temperature
    )
    if interactive:
        print(f"{agent}> ", end="", flush=True)
    for piece in stream:
        print(piece, end="", flush=True)
    print()
    s = stream.result.stats
    progress(
        f"[{s.cache}/{s.match}: reused {s.reused_tokens} of {s.stored_tokens} cached "
        f"tokens, prefilled {s.prefill_tokens}; first token {s.ttft_ms:.0f} ms, "
        f"{s.decode_tps:.1f} tok/s]" + (f" note: {s.reuse_note}" if s.reuse_note else "")
    )
    return stream.result.text

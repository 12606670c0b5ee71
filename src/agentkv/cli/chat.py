"""``agentkv chat --agent ID``: an interactive, streaming conversation that persists."""

from __future__ import annotations

import sys

from .output import progress


def run_chat(args) -> int:
    from ..agent_id import validate_agent_id
    from ..engine import Engine
    from .serve import engine_format

    agent = validate_agent_id(args.agent)
    progress("loading model...")
    with Engine(
        model=args.model,
        cache_dir=args.cache_dir,
        kv_bits=args.kv_bits,
        key_bits=args.key_bits,
        **engine_format(args),
    ) as eng:
        messages = eng.history(agent) or []
        if messages:
            progress(f"resuming {agent}: {len(messages)} messages so far")
        elif args.system:
            messages = [{"role": "system", "content": args.system}]
        interactive = sys.stdin.isatty()
        progress("type a message; /exit or Ctrl-D to leave")
        while True:
            try:
                line = input("you> " if interactive else "")
            except EOFError:
                break
            if line.strip() in ("/exit", "/quit"):
                break
            if not line.strip():
                continue
            messages.append({"role": "user", "content": line})
            stream = eng.stream_chat(
                agent, messages, max_tokens=args.max_tokens, temperature=args.temperature
            )
            print(f"{agent}> ", end="", flush=True)
            for piece in stream:
                print(piece, end="", flush=True)
            print()
            r = stream.result
            messages.append({"role": "assistant", "content": r.text})
            s = r.stats
            progress(
                f"[{s.cache}/{s.match}: reused {s.reused_tokens} of {s.stored_tokens} cached "
                f"tokens, prefilled {s.prefill_tokens}; first token {s.ttft_ms:.0f} ms, "
                f"{s.decode_tps:.1f} tok/s]" + (f" note: {s.reuse_note}" if s.reuse_note else "")
            )
    return 0

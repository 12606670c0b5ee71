"""``agentkv bench reload|ttft|save``."""

from __future__ import annotations


def _counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"agentkv: error: --tokens must be comma-separated integers, not {text!r}"
        ) from None
    if not counts or any(c < 1 for c in counts):
        raise SystemExit("agentkv: error: --tokens needs positive integers")
    return counts


def run_bench(args) -> int:
    if args.bench_command == "reload":
        from .reload import run

        run(_counts(args.tokens), repeats=args.repeats, as_json=args.json)
    elif args.bench_command == "ttft":
        from .ttft import run

        run(_counts(args.tokens), as_json=args.json, model=args.model)
    else:
        from .save import run

        run(args.tokens, args.turn, as_json=args.json)
    return 0

"""``agentkv bench reload|fleet|ttft|save|compute|perplexity|peers|kernels|gpu|batch|pool|
serve|constrained|quality|kv-candidates|kvswap``."""

from __future__ import annotations


def _counts(text: str, option: str = "--tokens") -> list[int]:
    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(
            f"agentkv: error: {option} must be comma-separated integers, not {text!r}"
        ) from None
    if not counts or any(c < 1 for c in counts):
        raise SystemExit(f"agentkv: error: {option} needs positive integers")
    return counts


def _require(command: str, module: str) -> None:
    """Stop with a clear error where a bench's client library is not installed (agentkv's
    own dependencies leave it out: the ``bench`` extra has it)."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        raise SystemExit(
            f"agentkv: error: agentkv bench {command} needs the {module} package, which agentkv "
            "does not install by itself: pip install 'agentkv[bench]'"
        ) from None


def _names(text: str, allowed, option: str) -> list[str]:
    """A comma-separated choice of ``allowed`` names (in the order given), or a clear exit."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names or set(names) - set(allowed):
        raise SystemExit(f"agentkv: error: {option} takes {','.join(allowed)}")
    return names


def run_bench(args) -> int:
    name = args.bench_command
    if name == "reload":
        from .reload import run

        run(_counts(args.tokens), repeats=args.repeats, as_json=args.json)
    elif name == "fleet":
        from .fleet import run

        if args.race_agents > args.agents:
            raise SystemExit("agentkv: error: --race-agents must be at most --agents")
        run(
            agents=args.agents,
            context=args.context,
            race_agents=args.race_agents,
            race_turns=args.race_turns,
            store=args.store,
            as_json=args.json,
        )
    elif name == "ttft":
        from .ttft import run

        run(_counts(args.tokens), as_json=args.json, model=args.model)
    elif name == "save":
        from .save import run

        run(args.tokens, args.turn, as_json=args.json)
    elif name == "compute":
        from .compute import AGENTKV_ARMS, run

        run(
            args.rounds,
            contexts=tuple(_counts(args.contexts, "--contexts")),
            short=args.short,
            hot=tuple(_counts(args.hot, "--hot")),
            decode_tokens=args.decode_tokens,
            batch_agents=args.batch_agents,
            batch_context=args.batch_context,
            peer=args.peer,
            agentkv_arms=tuple(_names(args.arms, AGENTKV_ARMS, "--arms")),
            model=args.model,
            as_json=args.json,
        )
    elif name == "perplexity":
        from .perplexity import run

        run(args.model, args.tokens, args.window, peer=args.peer, as_json=args.json)
    elif name == "peers":
        _require("peers", "openai")
        from .peers import SERVERS, run

        servers = tuple(_names(args.servers, SERVERS, "--servers"))
        run(
            quick=args.quick,
            agents=args.agents,
            rounds=args.rounds,
            system_tokens=args.system_tokens,
            max_tokens=args.max_tokens,
            servers=servers,
            peer=args.peer,
            as_json=args.json,
        )
    elif name == "kernels":
        from .kernels import run

        run(_counts(args.batches, "--batches"), repeats=args.repeats, as_json=args.json)
    elif name == "gpu":
        from .gpu import SHAPES, run

        run(
            tuple(_names(args.shapes, SHAPES, "--shapes")),
            tuple(_counts(args.contexts, "--contexts")),
            decode_tokens=args.decode_tokens,
            prefill_context=args.prefill_context,
            hot_tokens=args.hot_tokens,
            batch=args.batch,
            batch_context=args.batch_context,
            kernel_context=args.kernel_context,
            tokenizer=args.tokenizer,
            as_json=args.json,
        )
    elif name == "batch":
        from .batch import run

        run(_counts(args.agents, "--agents"), as_json=args.json, model=args.model)
    elif name == "pool":
        from .pool import run

        sections = _names(args.sections, ("shared", "decode", "overload", "ops"), "--sections")
        run(
            agents=args.agents,
            system_tokens=args.system_tokens,
            overload_agents=args.overload_agents,
            overload_tokens=args.overload_tokens,
            overload_fit=args.overload_fit,
            sections=sections,
            as_json=args.json,
        )
    elif name == "serve" and args.concurrent:
        _require("serve --concurrent", "openai")
        from .concurrent import run

        run(args.concurrent, args.turns or 3, args.max_tokens or 64, as_json=args.json)
    elif name == "serve":
        from .serve import run

        turns = 10 if args.turns is None else args.turns
        if turns < 2:
            raise SystemExit("agentkv: error: --turns must be at least 2 (a restart in the middle)")
        run(
            args.paragraphs,
            args.clients,
            turns,
            args.max_tokens or 24,
            as_json=args.json,
            tool_rounds=args.tool_rounds if args.tools else 0,
        )
    elif name == "constrained":
        from .constrained import run, run_engines

        if args.engines:
            run_engines(as_json=args.json, model=args.model)
        else:
            run(
                _counts(args.agents, "--agents"),
                max_tokens=args.max_tokens,
                repeats=args.repeats,
                as_json=args.json,
                model=args.model,
            )
    elif name == "kvswap":
        from .kvswap import run

        run(
            context=args.context,
            decode=args.decode,
            budget=args.budget,
            rank=args.rank,
            agents=0 if args.no_agents else args.agents,
            agent_decode=args.agent_decode,
            tune=args.tune,
            memory=args.memory or args.memory_only,
            texts_too=not args.memory_only,
            as_json=args.json,
        )
    elif name == "kv-candidates":
        from .kv_candidates import run

        contexts = _counts(args.context, "--context")
        if args.scored >= min(contexts):
            raise SystemExit("agentkv: error: --scored must be below every --context")
        names = [n.strip() for n in args.candidates.split(",")] if args.candidates else None
        kinds = _text_kinds(args.texts)
        try:
            run(
                context=contexts,
                segments=args.segments,
                scored=args.scored,
                names=names,
                as_json=args.json,
                model=args.model,
                text_kinds=kinds,
            )
        except ValueError as exc:
            raise SystemExit(f"agentkv: error: {exc}") from None
    elif getattr(args, "activations", False):
        from .quality import activations

        contexts = _counts(args.contexts, "--contexts") if args.contexts else None
        try:
            activations(
                args.tokens or 8192, contexts, as_json=args.json, model=args.model,
                text_kinds=_text_kinds(args.texts),
            )  # fmt: skip
        except ValueError as exc:
            raise SystemExit(f"agentkv: error: {exc}") from None
    else:
        from .quality import FORMATS, run

        formats = [f.strip() for f in args.formats.split(",") if f.strip()]
        unknown = sorted(set(formats) - set(FORMATS))
        if unknown or not formats:
            raise SystemExit(
                f"agentkv: error: --formats takes {','.join(FORMATS)}, not {args.formats!r}"
            )
        contexts = _counts(args.contexts, "--contexts") if args.contexts else None
        if contexts and any(c < 4 or c % 2 for c in contexts):
            raise SystemExit("agentkv: error: --contexts must be even numbers of at least 4")
        try:
            run(
                args.tokens or 20480,
                contexts,
                formats,
                quick=args.quick,
                as_json=args.json,
                model=args.model,
                text_kinds=_text_kinds(args.texts),
                greedy=not args.no_greedy,
                attention_only=args.attention_only,
            )
        except ValueError as exc:
            raise SystemExit(f"agentkv: error: {exc}") from None
    return 0


def _text_kinds(option: str | None) -> list[str] | None:
    kinds = [t.strip() for t in option.split(",") if t.strip()] if option else None
    if kinds is not None and (not kinds or set(kinds) - {"prose", "code"}):
        raise SystemExit("agentkv: error: --texts takes prose and/or code")
    return kinds

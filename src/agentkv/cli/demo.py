"""``agentkv demo``: agents work through the phases of a task, then resume after a restart.

Each agent keeps one growing conversation (seed 000's cross-phase context):
every phase appends to it, so each turn extends the agent's cached prefix.
Then a fresh process resumes every agent and the demo reports, per agent, the
time to first token of the same next turn three ways: cold (the whole context
prefilled from scratch, by a scratch agent), warm (the first turn after the
restart, cache reloaded from disk) and hot (the turn after, cache in memory).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile

from .output import progress, table

TASK = (
    "The team builds 'csvjson', a command line tool that converts CSV files to JSON. It must "
    "handle quoted fields, embedded newlines, other delimiters, a missing header row and files "
    "larger than memory, and its errors must name the line that failed."
)
ROLES = [
    ("planner", "You are the planner. You split the work into small steps and assign them."),
    ("coder", "You are the coder. You write short, correct Python and explain it briefly."),
    ("reviewer", "You are the reviewer. You point out bugs and risks in the team's work."),
    ("tester", "You are the tester. You describe pytest cases that would catch bugs."),
    ("writer", "You are the technical writer. You write the tool's user documentation."),
    ("ops", "You are the release engineer. You plan packaging, CI and releases."),
]
PHASES = [
    "Phase {n}: the project starts. {task} What is your first contribution?",
    "Phase {n}: here is what the others said: {others} Build on it: what do you do next?",
    "Phase {n}: the first release is near. The others reported: {others} What is left for you?",
    "Phase {n}: a user reports that quoted newlines break the parser. Others: {others} Your move?",
]
RESUME = "After the restart: in one sentence, what is your next action?"
AFTER = "And after that?"


def _phase_message(phase: int, name: str, outputs: dict) -> str:
    others = " ".join(
        f"[{who}] {text.strip()[:200]}" for who, text in outputs.items() if who != name
    )
    template = PHASES[min(phase, len(PHASES) - 1)]
    return template.format(n=phase + 1, task=TASK, others=others or "(nothing yet)")


def run_demo(args) -> int:
    if args.agents > len(ROLES):
        print(f"agentkv: error: --agents must be at most {len(ROLES)}", file=sys.stderr)
        return 2
    if args.resume_from:
        return _resume(args)
    from ..engine import Engine

    roles = ROLES[: args.agents]
    workdir = tempfile.mkdtemp(prefix="agentkv-demo-")
    try:
        progress(f"demo: {len(roles)} agents x {args.turns} phases; caches in {workdir}")
        with Engine(model=args.model, cache_dir=workdir) as eng:
            model_name, kv = eng.loaded.name, eng.quant.label
            conversations = {
                name: [{"role": "system", "content": f"{role} {TASK}"}] for name, role in roles
            }
            outputs: dict[str, str] = {}
            for phase in range(args.turns):
                for name, _ in roles:
                    conversations[name].append(
                        {"role": "user", "content": _phase_message(phase, name, outputs)}
                    )
                    r = eng.chat(name, conversations[name], max_tokens=args.max_tokens)
                    conversations[name].append({"role": "assistant", "content": r.text})
                    outputs[name] = r.text
                    s = r.stats
                    progress(
                        f"  phase {phase + 1}/{args.turns} {name:<9} {s.cache:<4} "
                        f"context {s.prompt_tokens:>5} tokens, reused {s.reused_tokens:>5}, "
                        f"first token {s.ttft_ms:7.0f} ms"
                    )
        progress(
            "demo: engine closed (every agent flushed to disk); restarting in a new process..."
        )
        command = [
            sys.executable,
            "-m",
            "agentkv.cli.main",
            "demo",
            "--resume-from",
            workdir,
            "--agents",
            str(args.agents),
            "--max-tokens",
            str(args.max_tokens),
        ]
        if args.model:
            command += ["--model", args.model]
        child = subprocess.run(command, capture_output=True, text=True)
        if child.returncode != 0:
            sys.stderr.write(child.stderr)
            return child.returncode
        rows = json.loads(child.stdout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {"model": model_name, "kv_bits": kv, "restart": "process", "agents": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        table(
            [
                "AGENT",
                "CONTEXT",
                "COLD TTFT",
                "WARM TTFT (after restart)",
                "HOT TTFT",
                "WARM SPEEDUP",
            ],
            [
                [
                    r["agent"],
                    f"{r['context_tokens']} tokens",
                    f"{r['cold_ttft_ms']:.0f} ms",
                    f"{r['warm_ttft_ms']:.0f} ms",
                    f"{r['hot_ttft_ms']:.0f} ms",
                    f"{r['cold_ttft_ms'] / r['warm_ttft_ms']:.1f}x",
                ]
                for r in rows
            ],
        )
    not_warm = [r["agent"] for r in rows if r["resumed_as"] != "warm"]
    if not_warm:
        print(f"agentkv: error: after the restart {not_warm} did not resume warm", file=sys.stderr)
        return 1
    return 0


def _resume(args) -> int:
    """The restarted process: resume each agent (warm), continue it (hot), redo it cold."""
    from ..engine import Engine

    rows = []
    with Engine(model=args.model, cache_dir=args.resume_from) as eng:
        for name, _ in ROLES[: args.agents]:
            history = eng.history(name)
            if not history:
                raise SystemExit(f"agent {name} has no stored conversation")
            turn = history + [{"role": "user", "content": RESUME}]
            warm = eng.chat(name, turn, max_tokens=args.max_tokens)
            hot = eng.chat(
                name,
                turn
                + [{"role": "assistant", "content": warm.text}, {"role": "user", "content": AFTER}],
                max_tokens=args.max_tokens,
            )
            # A scratch agent under its own salt: none of the real agents' blocks are
            # shared with it, so this is what the turn costs with no cache at all.
            cold = eng.chat(
                f"{name}.cold", turn, max_tokens=args.max_tokens, cache_salt=f"demo-cold-{name}"
            )
            eng.delete_agent(f"{name}.cold")
            progress(
                f"  resumed {name:<9} {warm.stats.cache}: context {warm.stats.stored_tokens} "
                f"tokens, first token cold {cold.stats.ttft_ms:.0f} ms / warm "
                f"{warm.stats.ttft_ms:.0f} ms / hot {hot.stats.ttft_ms:.0f} ms"
            )
            rows.append(
                {
                    "agent": name,
                    "context_tokens": warm.stats.stored_tokens,
                    "cold_ttft_ms": round(cold.stats.ttft_ms, 1),
                    "warm_ttft_ms": round(warm.stats.ttft_ms, 1),
                    "hot_ttft_ms": round(hot.stats.ttft_ms, 1),
                    "resumed_as": warm.stats.cache,
                    "warm_load_ms": round(warm.stats.load_ms, 2),
                }
            )
    print(json.dumps(rows))
    return 0

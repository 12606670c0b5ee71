"""``agentkv demo``: agents work through the phases of a task, then resume after a restart.

Each agent keeps one growing conversation (seed 000's cross-phase context):
every phase appends to it, so each turn extends the agent's cached prefix.
Then a fresh process resumes every agent and the demo reports, per agent, the
time to first token of its next turn three ways: warm (the first turn after the
restart, cache reloaded from disk), cold (the same turn with the whole context
prefilled from scratch, by a scratch agent) and hot (one more short question, cache
in memory).

Every progress line and table cell says how many tokens its turn prefilled: time to
first token follows that count. A hot phase turn prefills the other agents' replies,
so it can take nearly as long as a cold one; the table's hot turn prefills a few words.
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
    workdir = tempfile.mkdtemp(prefix="agentkv-demo-")
    try:
        model_name, kv = _work_through_phases(args, workdir)
        progress(
            "demo: engine closed (every agent flushed to disk); restarting in a new process..."
        )
        child = subprocess.run(_resume_command(args, workdir), capture_output=True, text=True)
        sys.stderr.write(child.stderr)  # its progress lines: each resumed turn, three ways
        if child.returncode != 0:
            return child.returncode
        rows = json.loads(child.stdout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    result = {"model": model_name, "kv_bits": kv, "restart": "process", "agents": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_table(rows)
    not_warm = [r["agent"] for r in rows if r["resumed_as"] != "warm"]
    if not_warm:
        print(f"agentkv: error: after the restart {not_warm} did not resume warm", file=sys.stderr)
        return 1
    return 0


def turn_summary(stats) -> str:
    """What a turn did: where its cache came from, the tokens it reused and prefilled.
    Time to first token follows the prefilled count, not the tier alone."""
    return f"{stats.cache:<4} reused {stats.reused_tokens:>5}, prefilled {stats.prefill_tokens:>5}"


def _work_through_phases(args, workdir: str) -> tuple[str, str]:
    """Every agent through every phase, each turn extending its conversation; returns the
    model's name and the KV format's label."""
    from ..engine import Engine

    roles = ROLES[: args.agents]
    progress(f"demo: {len(roles)} agents x {args.turns} phases; caches in {workdir}")
    progress("demo: a phase's turn prefills what the other agents said since its last one")
    with Engine(model=args.model, cache_dir=workdir) as eng:
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
                progress(
                    f"  phase {phase + 1}/{args.turns} {name:<9} {turn_summary(r.stats)} of "
                    f"{r.stats.prompt_tokens:>5} tokens; first token {r.stats.ttft_ms:7.0f} ms"
                )
        return eng.loaded.name, eng.quant.label


def _resume_command(args, workdir: str) -> list[str]:
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
    return command + ["--model", args.model] if args.model else command


def _print_table(rows: list[dict]) -> None:
    def ttft(row: dict, tier: str) -> str:
        return f"{row[f'{tier}_ttft_ms']:.0f} ms ({row[f'{tier}_prefill_tokens']} prefilled)"

    table(
        [
            "AGENT",
            "CONTEXT",
            "COLD TTFT",
            "WARM TTFT (after restart)",
            "HOT TTFT (next question)",
            "WARM SPEEDUP",
        ],
        [
            [
                r["agent"],
                f"{r['context_tokens']} tokens",
                ttft(r, "cold"),
                ttft(r, "warm"),
                ttft(r, "hot"),
                f"{r['cold_ttft_ms'] / r['warm_ttft_ms']:.1f}x",
            ]
            for r in rows
        ],
    )


def _resume(args) -> int:
    """The restarted process: resume each agent (warm), continue it (hot), redo it cold."""
    from ..engine import Engine

    with Engine(model=args.model, cache_dir=args.resume_from) as eng:
        rows = [_resume_agent(eng, name, args.max_tokens) for name, _ in ROLES[: args.agents]]
    print(json.dumps(rows))
    return 0


def _resume_agent(eng, name: str, max_tokens: int) -> dict:
    """One agent's next turn three ways: warm (its first after the restart), hot (the
    question after that) and cold (the warm turn again with nothing cached)."""
    history = eng.history(name)
    if not history:
        raise SystemExit(f"agent {name} has no stored conversation")
    turn = history + [{"role": "user", "content": RESUME}]
    warm = eng.chat(name, turn, max_tokens=max_tokens)
    after = [{"role": "assistant", "content": warm.text}, {"role": "user", "content": AFTER}]
    hot = eng.chat(name, turn + after, max_tokens=max_tokens)
    # A scratch agent under its own salt: none of the real agents' blocks are
    # shared with it, so this is what the turn costs with no cache at all.
    cold = eng.chat(f"{name}.cold", turn, max_tokens=max_tokens, cache_salt=f"demo-cold-{name}")
    eng.delete_agent(f"{name}.cold")
    progress(f"  resumed {name}: context {warm.stats.stored_tokens} tokens")
    row = {"agent": name, "context_tokens": warm.stats.stored_tokens}
    for tier, r in (("warm", warm), ("hot", hot), ("cold", cold)):
        progress(f"    {turn_summary(r.stats)}; first token {r.stats.ttft_ms:7.0f} ms")
        row[f"{tier}_ttft_ms"] = round(r.stats.ttft_ms, 1)
        row[f"{tier}_prefill_tokens"] = r.stats.prefill_tokens
    row["resumed_as"] = warm.stats.cache
    row["warm_load_ms"] = round(warm.stats.load_ms, 2)
    return row

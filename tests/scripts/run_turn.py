"""Run chat turns in a fresh process; print each result as one JSON line.

usage: run_turn.py CACHE_DIR AGENT MESSAGES_JSON [MESSAGES_JSON ...] [--max-tokens N] [--kv-bits B]
"""

import argparse
import json

import agentkv

parser = argparse.ArgumentParser()
parser.add_argument("cache_dir")
parser.add_argument("agent")
parser.add_argument("turns", nargs="+")
parser.add_argument("--max-tokens", type=int, default=32)
parser.add_argument("--kv-bits", type=int, default=4)
args = parser.parse_args()

with agentkv.Engine(cache_dir=args.cache_dir, kv_bits=args.kv_bits) as eng:
    for turn in args.turns:
        result = eng.chat(args.agent, json.loads(turn), max_tokens=args.max_tokens)
        print(json.dumps(result.to_dict()), flush=True)

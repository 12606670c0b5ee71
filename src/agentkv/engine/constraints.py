"""Constrained decoding: a grammar per turn decides which tokens may come next.

A caller asks for a ``Constraint`` (a JSON schema, any JSON object, a regex, a Lark grammar,
or tool calls in a format such as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``);
the engine's ``GrammarCompiler`` turns it into a ``TokenGrammar`` for one turn. At every step
the turn's row of logits is masked with the grammar's allowed tokens before sampling (a greedy
turn takes the row's own argmax where the grammar allows it, the same token, and masks only
where it does not), and the sampled token moves the grammar on. Each row of a batched decode
has its own grammar (or none), so constrained and free agents decode in one batch and a free
agent's tokens are the ones it gets alone. EOS is allowed exactly when the grammar accepts,
and the turn stops as soon as the grammar can take nothing more (``finish_reason``
``"stop"``).

JSON is written the way ``json.dumps`` writes it (``", "`` and ``": "``, no other
whitespace), so a small model cannot wander off into endless blank lines, and a tool call
re-rendered by ``json.dumps`` is the text the agent's cache holds.

Grammar engine: **llguidance** (guidance-ai; the engine behind llama.cpp's ``%llguidance``
grammars and one of vLLM's structured-output backends), chosen by measurement on our 2-core
Linux VM (AMD EPYC) with the embedded model's tokenizer (SmolLM2, 49,152 tokens); see
``benchmarks/RESULTS.md``, "Grammar engine choice":

============== ============== ================= ================== ===================
engine         tokenizer init schema compile    ``json_object``    mask per token
============== ============== ================= ================== ===================
llguidance     0.4-0.5 s      3.6 ms            0.7 ms             0.012-0.017 ms
xgrammar       0.16-0.35 s    7-11 ms           10-15 ms           0.002-0.003 ms
outlines-core  0.34-0.39 s    65-114 ms         8-15 s             0.002-0.010 ms
============== ============== ================= ================== ===================

Every mask is far below a decode step of the 135M model there (~75 ms), so the mask speed
does not decide. llguidance compiles fastest, has no dependencies (one abi3 wheel per platform,
Linux x86_64/aarch64 and macOS arm64, any Python >= 3.9), and takes JSON schemas, regexes and
Lark grammars that embed JSON schemas (``%json``) -- which is how a tool call with a forced
prefix is written. xgrammar requires PyTorch (and Triton on Linux: ~5 GB installed) for an
engine whose arrays are MLX; outlines-core compiles a schema to one regex and needs seconds
for a generic JSON object.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..errors import InvalidRequestError

# How JSON is written: json.dumps' separators, no other whitespace.
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
TOOL_CALL_BEGIN = "<tool_call>\n"
TOOL_CALL_END = "\n</tool_call>"
COMPILED_KEPT = 64  # compiled grammars kept per engine (a server sees the same tools again)


class GrammarError(InvalidRequestError):
    """A grammar that cannot be compiled, or that failed while a turn ran."""


class ToolSpec(NamedTuple):
    """A function the model may call: its name and the JSON schema of its arguments."""

    name: str
    parameters: Mapping | None = None  # None: any JSON object


@dataclass(frozen=True)
class Constraint:
    """What a turn's output must match, as a grammar in llguidance's Lark dialect.

    Build one with a class method; each checks its input at once and raises
    ``GrammarError`` (an ``InvalidRequestError``) naming what is wrong.
    """

    kind: str  # json_schema | json_object | regex | lark | tool_calls
    lark: str

    @classmethod
    def json_schema(cls, schema: Mapping | str, *, strict: bool = True) -> Constraint:
        """JSON that validates against ``schema``. ``strict=False`` ignores keywords the
        grammar engine does not implement instead of refusing the schema."""
        rule = _json_rule(schema, strict=strict)
        problem = _schema_problem(rule)
        if problem:
            raise GrammarError(f"the JSON schema cannot be followed: {problem}")
        return cls._checked("json_schema", f"start: {rule}")

    @classmethod
    def json_object(cls) -> Constraint:
        """Any JSON object (OpenAI's ``response_format: {"type": "json_object"}``)."""
        return cls._checked("json_object", f"start: {_json_rule({'type': 'object'})}")

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """Text matching ``pattern`` in full (Rust ``regex`` syntax: no look-around)."""
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("a regex constraint needs a non-empty pattern string")
        import llguidance

        return cls._checked("regex", f"start: /{llguidance.regex_to_lark(pattern)}/")

    @classmethod
    def lark(cls, grammar: str) -> Constraint:
        """A grammar in llguidance's Lark dialect (``start:`` rule; ``%json {...}`` embeds
        a JSON schema)."""
        if not isinstance(grammar, str) or not grammar.strip():
            raise GrammarError("a lark constraint needs a non-empty grammar string")
        return cls._checked("lark", grammar)

    @classmethod
    def tool_calls(
        cls,
        tools: Sequence[ToolSpec] | Mapping[str, Mapping | None],
        *,
        begin: str = TOOL_CALL_BEGIN,
        end: str = TOOL_CALL_END,
        parallel: bool = False,
        separator: str = "\n",
        arguments_key: str = "arguments",
        strict: bool = True,
        required: bool = True,
    ) -> Constraint:
        """One call (or, with ``parallel``, one or more joined by ``separator``) of one of
        ``tools``, each written ``{begin}{"name": NAME, "arguments": ARGS}{end}`` where ARGS
        validates against that tool's parameter schema: Hermes-style ``<tool_call>`` blocks
        by default (Llama 3.x: ``begin=""``, ``end=""``, ``arguments_key="parameters"``). For
        ``tool_choice`` "required" pass every tool; for a named tool, just that one.

        ``required=False`` is for ``tool_choice`` "auto": the reply is free text, but once it
        writes ``begin`` (without its trailing whitespace) a valid call must follow; any
        number of calls, text between and after them."""
        if isinstance(tools, Mapping):
            tools = [ToolSpec(name, params) for name, params in tools.items()]
        tools = [ToolSpec(*t) for t in tools]
        if not tools:
            raise GrammarError("tool_calls needs at least one tool")
        for tool in tools:
            if not isinstance(tool.name, str) or not tool.name:
                raise GrammarError("every tool needs a non-empty string name")
        if not all(isinstance(s, str) for s in (begin, end, separator)):
            raise GrammarError("begin, end and separator must be strings")
        if not isinstance(arguments_key, str) or not arguments_key or arguments_key == "name":
            raise GrammarError("arguments_key must be a non-empty string other than 'name'")
        for tool in tools:
            problem = json_schema_problem(_parameters(tool), strict=strict)
            if problem:
                raise GrammarError(f"tool {tool.name!r}: its parameters schema: {problem}")
        calls = [_call_schema(tool, arguments_key) for tool in tools]
        schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
        body = f"{_json_rule(schema, strict=strict)} {_literal(end)}"
        if not required:
            trigger = begin.rstrip()
            if not trigger:
                raise GrammarError("tool calls that are not required need a non-empty begin")
            after = _literal(begin[len(trigger) :])
            return cls._checked(
                "tool_calls",
                f"start: (text_then_call call)* TEXT\n"
                f"text_then_call[lazy]: TEXT {_literal(trigger)}\n"
                f"call: {after} {body}\n"
                "TEXT: /(.|\\n)*/",
            )
        more = f" ({_literal(separator)} call)*" if parallel else ""
        return cls._checked("tool_calls", f"start: call{more}\ncall: {_literal(begin)} {body}")

    @classmethod
    def _checked(cls, kind: str, lark: str) -> Constraint:
        error = _grammar_error(lark)
        if error:
            raise GrammarError(f"invalid {kind} constraint: {error}")
        return cls(kind, lark)


@functools.lru_cache(maxsize=256)
def _grammar_error(lark: str) -> str:
    """What is wrong with a grammar ("" if nothing): checked once per distinct grammar."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(lark))
    return "" if not error or error.startswith("WARNING") else error.strip()


def json_schema_problem(schema: Mapping | str, *, strict: bool = True) -> str | None:
    """What keeps ``schema`` from being followed as a reply's JSON, in the schema's own
    terms (None: nothing): the reason alone, without the grammar built around it."""
    return _schema_problem(_json_rule(schema, strict=strict))


def _schema_problem(rule: str) -> str | None:
    error = _grammar_error(f"start: {rule}")
    if not error:
        return None
    reason = error.split("\n   1 |", 1)[0]  # the grammar's listing follows the reason
    reason = re.sub(r"^at \d+\(\d+\): ", "", reason)
    reason = reason.removeprefix("failed to compile JSON schema: ")
    for rust, words in (("f64", "a number"), ("u64", "a whole number")):
        reason = reason.replace(f"Expected {rust}", f"expected {words}")
    return " ".join(reason.split())


def _json_rule(schema: Mapping | str, *, strict: bool = True) -> str:
    """A ``%json`` rule body for ``schema``, written in ``JSON_STYLE``."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
    if not isinstance(schema, Mapping):
        raise GrammarError("a JSON schema must be a JSON object")
    style = {**JSON_STYLE, "lenient": not strict}
    try:
        text = json.dumps({**schema, "x-guidance": style})
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"the JSON schema cannot be written as JSON: {exc}") from None
    return f"%json {text}"


def _parameters(tool: ToolSpec) -> Mapping:
    params = {"type": "object"} if tool.parameters is None else tool.parameters
    if not isinstance(params, Mapping):
        raise GrammarError(f"tool {tool.name!r}: its parameters must be a JSON schema object")
    return params


def _call_schema(tool: ToolSpec, arguments_key: str) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, arguments_key: dict(_parameters(tool))},
        "required": ["name", arguments_key],
        "additionalProperties": False,
    }


def _literal(text: str) -> str:
    return json.dumps(text) if text else '""'


class GrammarCompiler:
    """Compiles constraints against one tokenizer (one per engine). The token table takes
    ~0.5 s to build, once, on the first constrained turn (``agentkv serve`` builds it in the
    background as soon as an engine loads: ``warm_in_background``); a grammar then takes a few ms to
    compile, and the last ``COMPILED_KEPT`` are kept, so a turn with a grammar seen before
    starts from a copy (~10 us)."""

    def __init__(self, hf_tokenizer, eos_ids: frozenset[int]):
        self._hf_tokenizer = hf_tokenizer
        self._eos_ids = sorted(eos_ids)
        self._lock = threading.Lock()
        self._tokenizer = None  # llguidance.LLTokenizer, built on first use
        self._compiled: OrderedDict[str, object] = OrderedDict()  # lark -> fresh LLMatcher

    @property
    def tokenizer(self):
        with self._lock:
            if self._tokenizer is None:
                import llguidance.hf

                try:
                    self._tokenizer = llguidance.hf.from_tokenizer(
                        self._hf_tokenizer, eos_token=self._eos_ids
                    )
                except ValueError as exc:  # e.g. a slow (Python) tokenizer
                    raise GrammarError(
                        f"constrained decoding needs a fast Hugging Face tokenizer: {exc}"
                    ) from None
            return self._tokenizer

    def warm_in_background(self) -> threading.Thread:
        """Build the token table on a daemon thread now, so the first constrained turn (a
        server's first request that declares tools) does not wait ~0.5 s for it; a turn
        that comes sooner waits on the lock for the rest. A tokenizer that cannot be
        built is left for that turn to report."""

        def build():
            try:
                _ = self.tokenizer
            except GrammarError:
                pass

        thread = threading.Thread(target=build, name="agentkv-grammar-warm", daemon=True)
        thread.start()
        return thread

    def start(self, constraint: Constraint, *, prefix: str = "") -> TokenGrammar:
        """A fresh grammar state for one turn. ``prefix``: the reply's opening, already in
        the prompt (e.g. a forced ``<tool_call>{"name": "f", "arguments": ``); the grammar
        starts after it, so what is generated completes it."""
        if not isinstance(constraint, Constraint):
            raise InvalidRequestError("constraint must be an agentkv Constraint")
        import llguidance

        tokenizer = self.tokenizer
        with self._lock:
            fresh = self._compiled.get(constraint.lark)
            if fresh is not None:
                self._compiled.move_to_end(constraint.lark)
        if fresh is None:
            grammar = llguidance.LLMatcher.grammar_from_lark(constraint.lark)
            fresh = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            if fresh.is_error():
                raise GrammarError(f"invalid {constraint.kind} constraint: {fresh.get_error()}")
            with self._lock:
                self._compiled[constraint.lark] = fresh
                while len(self._compiled) > COMPILED_KEPT:
                    self._compiled.popitem(last=False)
        matcher = fresh.deep_copy()
        if prefix and not matcher.consume_tokens(tokenizer.tokenize_str(prefix)):
            raise GrammarError(
                f"the reply prefix {prefix!r} does not match the {constraint.kind} constraint"
            )
        return TokenGrammar(matcher, tokenizer.vocab_size)


class TokenGrammar:
    """One turn's grammar state: the mask for the next token, and the tokens taken so far.

    Used on the scheduler's thread only. ``mask`` then ``advance`` alternate, one pair per
    generated token."""

    def __init__(self, matcher, vocab_size: int):
        self._matcher = matcher
        self._bits = np.zeros((vocab_size + 31) // 32, dtype=np.int32)

    def mask(self, logits: mx.array) -> mx.array:
        """``logits`` (one row) with every token the grammar forbids set to -inf."""
        self._compute()
        return self._masked(logits)

    def argmax(self, logits: mx.array) -> mx.array:
        """``mx.argmax(self.mask(logits), axis=-1)``, the same token, without masking the row
        where the row's own argmax is allowed (nearly every step): a masked argmax is the
        first allowed index of the largest allowed value, and an allowed global argmax is
        that index. Saves the mask's ~0.1 ms of unpacking and the ``where`` over the
        vocabulary a token."""
        self._compute()
        best = mx.argmax(logits, axis=-1)
        token = int(best.item())
        if 0 <= token < self._bits.size * 32 and self._bits[token >> 5] >> (token & 31) & 1:
            return best
        return mx.argmax(self._masked(logits), axis=-1)

    def _compute(self) -> None:
        self._matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        if self._matcher.is_error():
            raise GrammarError(f"the output grammar failed: {self._matcher.get_error()}")

    def _masked(self, logits: mx.array) -> mx.array:
        vocab = logits.shape[-1]
        allowed = np.unpackbits(self._bits.view(np.uint8), count=vocab, bitorder="little")
        return mx.where(mx.array(allowed.view(np.bool_)), logits, -mx.inf)

    def advance(self, token: int) -> None:
        if not self._matcher.consume_token(token):
            raise GrammarError(f"the output grammar failed: {self._matcher.get_error()}")

    @property
    def done(self) -> bool:
        """The grammar is complete and can take no more text (only EOS)."""
        return self._matcher.is_stopped()

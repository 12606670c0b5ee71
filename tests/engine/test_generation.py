from hypothesis import given, settings
from hypothesis import strategies as st

from agentkv.engine.generation import (
    LAST_CHUNK_MAX,
    SCORES_BUDGET_BYTES,
    SamplingParams,
    StopScanner,
    plan_chunks,
)


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 20_000), offset=st.integers(0, 30_000), heads=st.sampled_from([1, 9, 32]))
def test_chunk_plan_covers_the_prompt_and_ends_short(n, offset, heads):
    sizes = plan_chunks(n, offset, max_chunk=512, query_heads=heads)
    assert sum(sizes) == n and all(s > 0 for s in sizes)
    assert sizes[-1] <= LAST_CHUNK_MAX
    assert all(s <= 512 for s in sizes)


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 20_000),
    offset=st.integers(0, 100_000),
    heads=st.sampled_from([1, 9, 32]),
    last=st.sampled_from([LAST_CHUNK_MAX, 200, 512, 4096]),
)
def test_a_model_projecting_its_last_position_alone_takes_a_longer_last_chunk(
    n, offset, heads, last
):
    sizes = plan_chunks(n, offset, max_chunk=512, query_heads=heads, last_max=last)
    assert sum(sizes) == n and all(0 < s <= 512 for s in sizes)
    assert sizes[-1] <= max(LAST_CHUNK_MAX, min(last, 512))
    # the last chunk's scores fit the budget at the prompt's end, as every chunk's do
    context = offset + n
    assert sizes[-1] <= max(LAST_CHUNK_MAX, SCORES_BUDGET_BYTES // (heads * 4 * context))
    if n > 1 and len(sizes) > 1:
        assert sizes[-1] >= LAST_CHUNK_MAX // 2
    if offset == 0 and n <= min(last, 512):
        assert sizes == [n]  # a hot turn's ~100 new tokens: one pass, not two


def test_chunks_shrink_as_the_context_grows():
    short = plan_chunks(4096, 0, max_chunk=2048, query_heads=9)
    long = plan_chunks(4096, 60_000, max_chunk=2048, query_heads=9)
    assert max(long) < max(short)


def test_stop_scanner_holds_back_a_possible_stop_and_cuts_at_it():
    scanner = StopScanner(("STOP",))
    shown = scanner.feed("Hello ST")
    assert shown == "Hello" and not scanner.stopped  # " ST" could start STOP
    shown += scanner.feed("OP and more")
    assert shown == "Hello " and scanner.stopped and scanner.text == "Hello "
    assert scanner.feed("ignored") == ""


def test_stop_scanner_without_stops_passes_everything():
    scanner = StopScanner(())
    assert scanner.feed("abc") == "abc" and scanner.feed("def") == "def"


def test_stop_scanner_releases_a_partial_match_that_was_not_a_stop():
    scanner = StopScanner(("<end>",))
    out = scanner.feed("a <en") + scanner.feed("try> b") + scanner.flush()
    assert out == "a <entry> b" and not scanner.stopped


def test_sampling_params_accept_one_stop_string():
    assert SamplingParams.create(stop="x").stop == ("x",)

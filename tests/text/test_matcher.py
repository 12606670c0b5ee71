from agentkv.text.matcher import MatchKind, common_prefix, match_prefix


def toks(*pieces: str):
    """(text, ends, ids) for a cache whose tokens are exactly these pieces."""
    text = "".join(pieces).encode()
    ends, pos = [], 0
    for p in pieces:
        pos += len(p.encode())
        ends.append(pos)
    return text, ends, list(range(100, 100 + len(pieces)))


def test_common_prefix():
    assert common_prefix(b"abcdef", b"abcxyz") == 3
    assert common_prefix(b"", b"abc") == 0
    assert common_prefix(b"abc", b"abc") == 3


def test_exact_reuses_all_but_the_last_token_and_refeeds_it():
    text, ends, ids = toks("Hello", " world", "!")
    m = match_prefix(text, ends, ids, b"Hello world!", min_reuse=1)
    assert m.kind is MatchKind.EXACT
    assert (m.reuse, m.refeed, m.resume_at) == (2, ids[2], len(text))
    assert "fed again" in m.note


def test_extend_reuses_every_token():
    text, ends, ids = toks("Hello", " world")
    m = match_prefix(text, ends, ids, b"Hello world, again", min_reuse=1)
    assert (m.kind, m.reuse, m.refeed, m.resume_at) == (MatchKind.EXTEND, 2, None, 11)
    assert m.note is None


def test_extension_that_retokenizes_the_boundary_still_reuses_everything():
    # "Hello wor" was cached as [Hello][ wor]; the new text "Hello world" would be
    # tokenized [Hello][ world] from scratch, yet the whole cache is reused and only
    # "ld" is left to prefill.
    text, ends, ids = toks("Hello", " wor")
    m = match_prefix(text, ends, ids, b"Hello world", min_reuse=1)
    assert (m.kind, m.reuse, m.resume_at) == (MatchKind.EXTEND, 2, len(b"Hello wor"))


def test_partial_trims_to_the_last_token_inside_the_common_prefix():
    text, ends, ids = toks("The", " cat", " sat", " down")
    m = match_prefix(text, ends, ids, b"The cat sits", min_reuse=2)
    assert m.kind is MatchKind.PARTIAL
    assert (m.reuse, m.resume_at, m.common) == (2, len(b"The cat"), len(b"The cat s"))
    assert "diverged at byte 9" in m.note and "2 cached tokens dropped" in m.note


def test_partial_below_the_minimum_is_diverge():
    text, ends, ids = toks("The", " cat", " sat", " down")
    m = match_prefix(text, ends, ids, b"The cat sits", min_reuse=3)
    assert (m.kind, m.reuse) == (MatchKind.DIVERGE, 0)
    assert "only 2 of 4 cached tokens in common (partial reuse starts at 3)" in m.note


def test_diverge_when_nothing_matches():
    text, ends, ids = toks("abc", "def")
    m = match_prefix(text, ends, ids, b"xyz", min_reuse=1)
    assert (m.kind, m.reuse, m.resume_at) == (MatchKind.DIVERGE, 0, 0)


def test_prompt_that_is_a_prefix_of_the_cache_refeeds_its_last_token():
    text, ends, ids = toks("The", " cat", " sat", " down")
    m = match_prefix(text, ends, ids, b"The cat sat", min_reuse=1)
    assert (m.kind, m.reuse, m.refeed) == (MatchKind.PARTIAL, 2, ids[2])


def test_cut_never_splits_a_character():
    # A byte-level token can end inside a multi-byte character ("é" = c3 a9).
    text = "café".encode()
    ends = [3, 4, 5]  # [caf][\xc3][\xa9]
    m = match_prefix(text, ends, [1, 2, 3], "cafè!".encode(), min_reuse=1)  # è = c3 a8
    assert m.common == 4
    assert m.reuse == 1 and m.resume_at == 3  # not after \xc3, which is mid-character


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pieces = st.lists(st.text(alphabet="ab é🙂\n", min_size=1, max_size=4), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    cached=pieces,
    prompt=st.text(alphabet="ab é🙂\n", min_size=1, max_size=40),
    min_reuse=st.integers(0, 6),
)
def test_match_invariants(cached, prompt, min_reuse):
    text, ends, ids = toks(*cached)
    data = prompt.encode()
    m = match_prefix(text, ends, ids, data, min_reuse=min_reuse)
    kept = m.reuse + (m.refeed is not None)
    assert 0 <= m.reuse <= len(ends) and kept <= len(ends)
    # what is kept is exactly a prefix of the prompt, ending where prefill resumes
    covered = ends[kept - 1] if kept else 0
    assert text[:covered] == data[:covered]
    if m.kind is not MatchKind.DIVERGE:
        assert m.resume_at == covered
        data[m.resume_at :].decode()  # the rest is whole characters
        assert m.refeed is None or m.resume_at == len(data)
    if m.kind in (MatchKind.EXACT, MatchKind.EXTEND):
        assert kept == len(ends)
    if m.kind is MatchKind.PARTIAL:
        assert kept >= min_reuse

"""Detokenizing by joining per-id bytes (``qil_worker.text.token_bytes``) gives exactly what the
tokenizer's ``decode`` gives, and the incremental detokenizer and stop-string matcher built on
it stream exactly what their general paths stream: over random id sequences rich in split
multi-byte characters, special and added tokens, ids past the vocabulary, both
``skip_special_tokens`` settings; a tokenizer that decodes otherwise falls back to ``decode``."""

from __future__ import annotations

import random

import pytest

from checkpoints import make_tokenizer
from qil_worker.text import detokenizer as detokenizer_module
from qil_worker.text import token_bytes as token_bytes_module
from qil_worker.text.detokenizer import IncrementalDetokenizer
from qil_worker.text.stop_strings import StopStringMatcher
from qil_worker.text.token_bytes import BYTE_OF, TokenBytes, token_bytes

TEXTS = ["héllo wörld 中文字符 🙂🚀 — fin", "a\ufffdb ß ğ Ω ∑ ﬁ", "plain ascii, and more."]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """The tests' byte-level BPE with added tokens of each kind: plain ones spelled in the
    byte-level alphabet ("aĠb" decodes to "a b"), with characters outside it (their own
    UTF-8), one that is a lone high byte in the alphabet ("é" stands for byte 0xE9), and a
    special one."""
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    tok.add_tokens(["aĠb", "日本", "Ġ日", "é", "x☃"])
    tok.add_special_tokens({"additional_special_tokens": ["<spĠx>"]})
    return tok


def _pool(tok) -> list[int]:
    vocab = tok.get_vocab()
    single_bytes = [vocab[c] for c in BYTE_OF if c in vocab]
    high = [i for t, i in vocab.items() if any(BYTE_OF.get(c, 0) >= 0x80 for c in t)]
    added = list(tok.added_tokens_decoder)
    encoded = [i for text in TEXTS for i in tok.encode(text, add_special_tokens=False)]
    return single_bytes * 2 + high + added * 3 + encoded + [len(tok), len(tok) + 7]


def _streams(tok, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    pool = _pool(tok)
    out = [tok.encode(text, add_special_tokens=False) for text in TEXTS]
    out += [[rng.choice(pool) for _ in range(rng.randint(1, 30))] for _ in range(count)]
    return out


def test_the_alphabet_is_the_byte_level_pre_tokenizers():
    from tokenizers import pre_tokenizers

    assert sorted(BYTE_OF.values()) == list(range(256))
    assert set(BYTE_OF) == set(pre_tokenizers.ByteLevel.alphabet())


@pytest.mark.parametrize("skip", [True, False])
def test_joined_bytes_decode_as_the_tokenizer(tokenizer, skip):
    table = token_bytes(tokenizer, skip)
    assert table is not None and token_bytes(tokenizer, skip) is table  # one per tokenizer and setting
    for ids in _streams(tokenizer, 3000, seed=1):
        want = tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
        assert table.decode(ids) == want, ids
    assert table.usable
    special = tokenizer.convert_tokens_to_ids("<spĠx>")
    assert table.bytes_of(special) == (b"" if skip else b"<sp x>")
    assert table.bytes_of(tokenizer.convert_tokens_to_ids("é")) == b"\xe9"  # a lone byte: U+FFFD alone
    assert table.bytes_of(tokenizer.convert_tokens_to_ids("x☃")) == "x☃".encode()
    assert table.whole_text(tokenizer.convert_tokens_to_ids("é")) == ""
    assert table.whole_text(tokenizer.convert_tokens_to_ids("aĠb")) == "a b"


def _general(monkeypatch) -> None:
    """The detokenizer as it is without the table: every window decoded by the tokenizer."""
    monkeypatch.setattr(detokenizer_module, "token_bytes", lambda tokenizer, skip: None)


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_deltas_equal_those_decoded_by_the_tokenizer(tokenizer, skip, monkeypatch):
    streams = _streams(tokenizer, 1500, seed=2)
    fast = []
    for ids in streams:
        d = IncrementalDetokenizer(tokenizer, skip)
        fast.append([d.push(t) for t in ids] + [d.finish()])
        assert "".join(fast[-1]) == tokenizer.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)
    with monkeypatch.context() as patched:
        _general(patched)
        general = []
        for ids in streams:
            d = IncrementalDetokenizer(tokenizer, skip)
            assert d._bytes is None
            general.append([d.push(t) for t in ids] + [d.finish()])
    assert fast == general
    assert any(d == "" for deltas in fast for d in deltas[:-1]), "some token should end mid-character"


def test_a_tokenizer_that_decodes_otherwise_is_asked_itself(tokenizer):
    """An id whose ``decode`` disagrees with its bytes turns the table off (here a tokenizer
    whose backend spells one id differently from what its decode says); deltas stay exact."""
    ids = tokenizer.encode("hello wörld", add_special_tokens=False)
    table = TokenBytes(tokenizer, True)
    backend = table._backend

    class Lying:
        def __getattr__(self, name):
            return getattr(backend, name)

        def id_to_token(self, token_id):
            return "Ġzz" if token_id == ids[2] else backend.id_to_token(token_id)

    table._backend = Lying()
    assert table.decode(ids[:2]) == tokenizer.decode(ids[:2])
    assert table.decode(ids) is None and not table.usable
    d = IncrementalDetokenizer(tokenizer)
    d._bytes, d._settled = table, True
    reference = IncrementalDetokenizer(tokenizer)
    assert [d.push(t) for t in ids] + [d.finish()] == [reference.push(t) for t in ids] + [reference.finish()]
    assert d._bytes is None  # asks the tokenizer from then on


def test_tokenizers_of_other_kinds_get_no_table(tokenizer, tmp_path):
    from tokenizers import decoders

    other = make_tokenizer(tmp_path)
    other.backend_tokenizer.decoder = decoders.Metaspace()
    assert token_bytes(other, True) is None
    patched = make_tokenizer(tmp_path / "patched")
    patched.decode = lambda *args, **kwargs: "x"  # an instance that decodes its own way
    assert token_bytes(patched, True) is None
    assert token_bytes_module._joins_bytes(tokenizer)
    d = IncrementalDetokenizer(other)
    ids = other.encode("héllo", add_special_tokens=False)
    assert "".join(d.push(t) for t in ids) + d.finish() == other.decode(ids, clean_up_tokenization_spaces=False)


def test_tokens_added_after_first_use_are_decoded_as_the_tokenizer_does(tmp_path):
    tok = make_tokenizer(tmp_path)
    table = token_bytes(tok, True)
    first = tok.encode("hello", add_special_tokens=False)
    assert table.decode(first) == "hello"
    tok.add_special_tokens({"additional_special_tokens": ["<new>"]})
    tok.add_tokens(["zzĠ"])
    ids = first + tok.convert_tokens_to_ids(["<new>", "zzĠ"])
    assert table.decode(ids) == tok.decode(ids, skip_special_tokens=True) == "hellozz "
    assert token_bytes(tok, False).decode(ids) == tok.decode(ids) == "hello<new>zz "


# -- stop strings: the matcher against the plain rule it implements -----------------------------


class ReferenceMatcher:
    """Stop strings as first written: search the whole text, hold back the longest suffix that
    starts a stop string by trying every one."""

    def __init__(self, stops, include):
        self.stops, self.include = tuple(s for s in stops if s), include
        self.text, self.released, self.matched = "", 0, None

    def feed(self, delta):
        if self.matched is not None:
            return ""
        self.text += delta
        hits = [(self.text.find(s), i, s) for i, s in enumerate(self.stops) if s in self.text]
        if hits:
            at, _, stop = min(hits)
            self.matched = stop
            return self._release(at + len(stop) if self.include else at)
        longest = max((len(s) for s in self.stops), default=0)
        held = next(
            (k for k in range(min(longest - 1, len(self.text)), 0, -1)
             if any(s.startswith(self.text[-k:]) for s in self.stops)),
            0,
        )
        return self._release(len(self.text) - held)

    def flush(self):
        return "" if self.matched is not None else self._release(len(self.text))

    def _release(self, end):
        end = max(end, self.released)
        out, self.released = self.text[self.released:end], end
        return out


def test_stop_string_matcher_streams_as_the_reference():
    rng = random.Random(3)
    alphabet = "ab.S T\ufffdé"
    for _ in range(20000):
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(0, 3))]
        include = rng.random() < 0.5
        fast, reference = StopStringMatcher(stops, include), ReferenceMatcher(stops, include)
        for _ in range(rng.randint(0, 12)):
            delta = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 4)))
            assert fast.feed(delta) == reference.feed(delta), (stops, include)
            assert fast.matched == reference.matched
        assert fast.flush() == reference.flush()

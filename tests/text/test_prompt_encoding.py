"""Encoding long prompts in pieces gives the ids of the whole text; a prompt that cannot fit is
refused without encoding it all (the size bound first, then counting piece by piece)."""

from __future__ import annotations

import random
import time

import pytest

from checkpoints import make_tokenizer
from qil_worker.errors import CapacityError
from qil_worker.model.demo import ensure_demo_model
from qil_worker.engine.spec import RequestSpec
from qil_worker.service.worker.prompt_encoder import encode_within
from qil_worker.text import load_tokenizer
from qil_worker.text.prompt import PIECE_CHARS, PromptRoom, PromptTooLong, encode_text, piece_ends
from qil_worker.text.tokenizer import encoding_traits, min_tokens

ALPHABET = list("abc xyz  \n\n\r\t.,;'!?0123456789éü日本語한국어 ") + [
    "\u0301", "\u200b", "\x1c", "\u00a0", "\u3000", "<|im_end|>", "'s", " 's", "  \n", "\r\n", "e\u0301",
]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The demo model's (Qwen's pre-tokenizer regex and NFC) and a trained GPT-2-style one."""
    return [load_tokenizer(ensure_demo_model()), make_tokenizer(tmp_path_factory.mktemp("tok"))]


def test_traits_allow_pieces_and_bound_bytes(tokenizers):
    for tok in tokenizers:
        traits = encoding_traits(tok)
        assert traits.splits_at_whitespace
        assert traits.max_token_bytes == max(len(t.encode()) if t.startswith("<|") else len(t)
                                             for t in tok.get_vocab())


@pytest.mark.parametrize("seed", range(8))
def test_pieces_give_the_ids_of_the_whole_text(tokenizers, seed):
    rng = random.Random(seed)
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3 * PIECE_CHARS, 5 * PIECE_CHARS)))
    if seed % 2:  # long runs without any whitespace, and of whitespace alone
        text = text[:PIECE_CHARS] + "x" * (2 * PIECE_CHARS) + " \n\t" * 5000 + text[PIECE_CHARS:]
    assert len(list(piece_ends(text))) > 2
    for tok in tokenizers:
        assert encode_text(tok, text) == list(tok.encode(text, add_special_tokens=False))


def test_min_tokens_is_a_lower_bound(tokenizers):
    rng = random.Random(1)
    for tok in tokenizers:
        traits = encoding_traits(tok)
        for n in (1, 50, 5000):
            text = "".join(rng.choice(ALPHABET) for _ in range(n))
            count = len(tok.encode(text, add_special_tokens=False))
            assert 0 < min_tokens((text,), traits.max_token_bytes, traits.normal_form) <= count


def test_a_huge_prompt_is_refused_at_once(tokenizers):
    room = PromptRoom(max_positions=2048, num_pages=512, page_size=16)
    text = "word " * (10 * 2**20 // 5)  # 10 MiB
    for tok in tokenizers:
        t0 = time.perf_counter()
        with pytest.raises(CapacityError) as err:
            encode_within(tok, RequestSpec.of(text=text, max_new_tokens=2), room)
        assert time.perf_counter() - t0 < 0.5
        assert str(err.value).startswith("text: prompt (at least ")  # the prompt alone cannot fit
        assert "exceeds the model's 2048 positions" in str(err.value)


def test_counting_stops_in_the_pieces(tokenizers):
    """Under the size bound (many short tokens), the count still stops early: the text's
    first pieces show that it cannot fit."""
    tok = tokenizers[1]
    text = "a b c d " * (2**20 // 8)
    assert min_tokens((text,), encoding_traits(tok).max_token_bytes) < 100_000
    t0 = time.perf_counter()
    with pytest.raises(PromptTooLong) as err:
        encode_text(tok, text, max_tokens=1000)
    assert not err.value.exact and 1000 < err.value.at_least < 100_000
    room = PromptRoom(max_positions=100_000, num_pages=8, page_size=16)
    with pytest.raises(CapacityError, match=r"needs at least \d+ KV pages but the whole pool has 8"):
        encode_within(tok, RequestSpec.of(text=text, max_new_tokens=4), room)
    assert time.perf_counter() - t0 < 0.5
    assert len(encode_text(tok, text[:20_000], max_tokens=100_000)) > 1000  # fits: every id


def test_chat_messages_are_bounded_too(tokenizers):
    room = PromptRoom(max_positions=2048)
    with pytest.raises(CapacityError, match="at least"):
        encode_within(tokenizers[0], RequestSpec.of(messages=[{"role": "user", "content": "hi " * 2**20}], max_new_tokens=2), room)


def test_an_empty_chat_is_blamed_on_messages():
    from qil_client.results import submit_request

    with pytest.raises(ValueError, match="^messages: "):
        submit_request(messages=[])


def test_outsized_jobs_release_memory_once_all_are_done(tokenizers):
    from qil_worker.freed_memory import OUTSIZED_CHARS, release_outsized
    from qil_worker.service.worker.beside_loop import Pending
    from qil_worker.service.worker.prompt_encoder import PromptEncoder

    assert release_outsized()  # glibc: malloc_trim is there
    enc = PromptEncoder(tokenizers[0], PromptRoom(max_positions=2048))
    enc.start(Pending(RequestSpec.of(text="x" * OUTSIZED_CHARS, max_new_tokens=2, request_id="big")))
    enc.start(Pending(RequestSpec.of(text="y" * 20000, max_new_tokens=2, request_id="small")))
    assert not enc.take_outsized()  # (still encoding)
    deadline = time.monotonic() + 30
    done = []
    while len(done) < 2 and time.monotonic() < deadline:
        enc.wait(1.0)
        done += enc.finished()
    assert [type(error).__name__ for _, error, _ in done] == ["CapacityError", "CapacityError"]
    assert enc.take_outsized() and not enc.take_outsized()
    enc.close()

"""Text in and out: prompts and chat templates (the thinking switch, roles, long chat prompts),
incremental detokenization, special tokens, stop strings (hold-back, precedence, text released
at the end)."""

import pytest

from checkpoints import make_text_checkpoint
from engine_helpers import run_to_completion
from qil_worker import Engine, FinishReason, InvalidRequestError, Qwen3
from qil_worker.errors import TokenizerUnavailableError
from qil_worker.service.worker.prompt_encoder import INLINE_CHARS, PromptEncoder
from qil_worker.engine.spec import RequestSpec
from qil_worker.service.worker.beside_loop import Pending
from qil_worker.text import IncrementalDetokenizer, StopStringMatcher, encode_prompt, load_tokenizer
from qil_worker.text.output import TextOutput

SAMPLE = "héllo wörld 中文字符 🙂🚀 — fin"


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("text"))


@pytest.fixture(scope="module")
def tokenizer(text_dir):
    return load_tokenizer(text_dir)


@pytest.fixture(scope="module")
def engine(text_dir, tokenizer):
    return Engine(Qwen3.from_directory(text_dir), num_pages=64, page_size=8, tokenizer=tokenizer)


def test_multibyte_characters_split_across_tokens_come_out_whole(tokenizer):
    ids = tokenizer.encode(SAMPLE, add_special_tokens=False)
    assert len(ids) > len(SAMPLE) // 2, "expected several tokens per non-ASCII character"
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.push(t) for t in ids] + [detok.finish()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == SAMPLE
    assert any(d == "" for d in deltas), "some token should have ended mid-character"


def test_stop_string_matcher_across_deltas_and_hold_back():
    m = StopStringMatcher(["STOP", "xyz"])
    assert m.feed("abc S") == "abc "  # "S" could start STOP: held back
    assert m.feed("T") == ""
    assert m.feed("Oq") == "STOq"  # not a stop after all: released
    assert m.feed("ST") == ""
    assert m.feed("OP and more") == "" and m.matched == "STOP"
    assert m.flush() == ""
    inc = StopStringMatcher(["STOP"], include_stop_string=True)
    assert inc.feed("go ST") + inc.feed("OP!") == "go STOP" and inc.matched == "STOP"
    plain = StopStringMatcher(["zz"])
    assert plain.feed("abz") == "ab" and plain.flush() == "z"


@pytest.mark.parametrize("skip_special", [True, False])
def test_streamed_text_equals_decode_of_output_ids(engine, tokenizer, skip_special):
    rid = engine.submit(text="hello world", max_new_tokens=40, temperature=1.0, seed=3,
                        ignore_eos=True, skip_special_tokens=skip_special)
    events = run_to_completion(engine)
    res = engine.result(rid)
    streamed = "".join(e.text for e in events if e.request_id == rid)
    assert streamed == tokenizer.decode(res.output_token_ids, skip_special_tokens=skip_special,
                                        clean_up_tokenization_spaces=False)
    assert streamed == res.output_text
    assert res.prompt_token_ids == tokenizer.encode("hello world", add_special_tokens=False)


def test_stop_string_spanning_a_token_boundary(engine, tokenizer):
    base = dict(text="the quick", max_new_tokens=30, temperature=1.0, seed=11, ignore_eos=True)
    full_id = engine.submit(**base)
    run_to_completion(engine)
    full = engine.result(full_id)
    pieces = [tokenizer.decode([t]) for t in full.output_token_ids]
    # a stop string made of the last character of one token's text and the first of the next
    i = next(i for i in range(3, len(pieces) - 1)
             if pieces[i] and pieces[i + 1] and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[i][-1] + pieces[i + 1][0]
    for include in (False, True):
        rid = engine.submit(**base, stop_strings=[stop, "never-seen"], include_stop_string=include)
        events = run_to_completion(engine)
        res = engine.result(rid)
        assert res.finish_reason is FinishReason.STOP and res.stop_reason == stop
        assert res.output_token_ids == full.output_token_ids[: len(res.output_token_ids)]
        expected = full.output_text[: full.output_text.find(stop) + (len(stop) if include else 0)]
        assert res.output_text == expected
        assert "".join(e.text for e in events if e.request_id == rid) == expected


def test_chat_messages_use_the_template(engine, tokenizer):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    for thinking in (None, False):
        rid = engine.submit(messages=messages, max_new_tokens=3, enable_thinking=thinking)
        kwargs = {} if thinking is None else {"enable_thinking": thinking}
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        assert engine.result(rid).prompt_token_ids == tokenizer.encode(rendered, add_special_tokens=False)
        assert engine.num_prompt_tokens(rid) == len(engine.result(rid).prompt_token_ids)
        assert ("<think>" in rendered) == (thinking is False)
    run_to_completion(engine)


def test_text_errors(engine, text_dir):
    with pytest.raises(InvalidRequestError) as info:
        engine.submit(messages=[{"role": "robot", "content": "x"}])
    assert info.value.field == "messages[0]"
    with pytest.raises(InvalidRequestError):
        engine.submit([1, 2], text="both")
    with pytest.raises(InvalidRequestError) as info:
        engine.submit([1, 2], stop_strings="STOP")
    assert info.value.field == "stop_strings"
    bare = Engine(Qwen3.from_directory(text_dir), num_pages=8, page_size=8)
    for kwargs, field in ((dict(text="hello"), "text"), (dict(messages=[{"role": "user", "content": "x"}]), "messages"),
                          (dict(token_ids=[1, 2], stop_strings=["x"]), "stop_strings")):
        with pytest.raises(TokenizerUnavailableError) as info:
            bare.submit(**kwargs)
        assert info.value.field == field
    with pytest.raises(TokenizerUnavailableError, match="no tokenizer files"):
        load_tokenizer(text_dir / "nonexistent")


@pytest.fixture(scope="module")
def split_char_tokenizer(tmp_path_factory):
    """A byte-level BPE with a token b" \\xc3": a space and the first byte of "é", as real
    byte-level vocabularies have for common characters."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=260, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator([" é è à ç ê ë î ï ô û ù ü ÿ ñ" * 10], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    ids = fast.encode("b: éxyz", add_special_tokens=False)
    assert fast.decode(ids[:3]) == "b: \ufffd", "the vocabulary should split é after its first byte"
    return fast


def test_a_stop_string_completed_mid_character_stops_at_that_token(split_char_tokenizer):
    """transformers' StopStringCriteria stops at the token that completes ": " even though it
    also starts "é"; the whole characters before an incomplete one are released at once."""
    tok = split_char_tokenizer
    ids = tok.encode("b: éxyz", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.push(t) for t in ids] + [detok.finish()]
    assert deltas[:4] == ["b", ":", " ", "é"] and "".join(deltas) == "b: éxyz"
    out = TextOutput(tok, [": "])
    pushed = []
    for t in ids:
        pushed.append(out.push(t))
        if out.matched_stop is not None:
            break
    assert len(pushed) == 3 and out.matched_stop == ": " and out.text == "b"


def test_text_cut_at_a_stop_string_always_ends_with_reason_stop(text_dir, split_char_tokenizer, monkeypatch):
    """A stop string first seen in the text released when the request ends at max_new_tokens
    (here the U+FFFD of a character the last token left incomplete) makes the reason STOP."""
    import torch

    from qil_worker.engine.sampler import DeviceSample

    tok = split_char_tokenizer
    engine = Engine(Qwen3.from_directory(text_dir), num_pages=16, page_size=8, tokenizer=tok)
    script = tok.encode("b: é", add_special_tokens=False)[:3]

    def scripted(logits, requests):
        return DeviceSample(torch.tensor([script[r.num_output_tokens] for r in requests]))

    monkeypatch.setattr(engine.runner.sampler, "sample_on_device", scripted)
    rid = engine.submit([1, 2], max_new_tokens=3, stop_strings=["\ufffd"])
    events = run_to_completion(engine)
    result = engine.result(rid)
    assert result.finish_reason is FinishReason.STOP and result.stop_reason == "\ufffd"
    assert result.output_text == "b: " == "".join(e.text for e in events)


def test_a_chat_template_that_refuses_the_messages_is_an_invalid_request(text_dir, tokenizer):
    """Qwen3's templates raise when no user message is given; that is the caller's mistake."""
    engine = Engine(Qwen3.from_directory(text_dir), num_pages=8, page_size=8, tokenizer=tokenizer)
    original = tokenizer.chat_template
    tokenizer.chat_template = (
        "{% if not messages | selectattr('role', 'equalto', 'user') | list %}"
        "{{ raise_exception('No user query found in messages.') }}{% endif %}" + original
    )
    try:
        with pytest.raises(InvalidRequestError) as info:
            engine.submit(messages=[{"role": "system", "content": "be brief"}])
    finally:
        tokenizer.chat_template = original
    assert info.value.field == "messages" and "No user query found" in str(info.value)
    assert engine.idle


@pytest.fixture(scope="module")
def tok(tokenizer):
    """The module's tokenizer under the short name the tests below use."""
    return tokenizer


def test_stop_completed_by_its_last_char_only():
    m = StopStringMatcher(["STOP"])
    assert m.feed("go STO") == "go "
    assert m.feed("P!") == "" and m.matched == "STOP"


def test_text_output_finish_releases_held_back_text(tok):
    out = TextOutput(tok, ["xyzzy"])
    ids = tok.encode("hello x", add_special_tokens=False)
    streamed = "".join(out.push(t) for t in ids) + out.finish()
    assert out.matched_stop is None
    assert streamed == "hello x" == out.text


def test_explicit_enable_thinking_true(tok):
    msgs = [{"role": "user", "content": "hi"}]
    want = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True)
    assert encode_prompt(tok, messages=msgs, enable_thinking=True) == tok.encode(want, add_special_tokens=False)
    assert "<think>" not in want


def test_tool_role_accepted(tok):
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x"},
            {"role": "tool", "content": "42"}]
    assert encode_prompt(tok, messages=msgs)


def test_skip_special_tokens_false_keeps_specials(tok):  # D9 / T4
    ids = tok.encode("hello<|im_end|> world", add_special_tokens=False)
    for cls in (IncrementalDetokenizer, TextOutput):
        d = cls(tok, skip_special_tokens=False)
        s = "".join(d.push(t) for t in ids) + d.finish()
        assert s == "hello<|im_end|> world", cls


def test_detokenizer_does_not_clean_up_spaces(tok):
    ids = tok.encode("hello , world .", add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    assert "".join(d.push(t) for t in ids) + d.finish() == "hello , world ."


def test_long_chat_prompt_keeps_enable_thinking(tok):
    msgs = [{"role": "user", "content": "hello " * (INLINE_CHARS // 5)}]
    enc = PromptEncoder(tok)
    spec = RequestSpec.of(messages=msgs, enable_thinking=False, max_new_tokens=4, request_id="r1")
    assert enc.takes(spec)
    enc.start(Pending(spec))
    while not enc.wait(5):
        pass
    ((submit, error, cancelled),) = enc.finished()
    enc.close()
    assert error is None and not cancelled
    prompt = submit.spec.prompt
    assert prompt.token_ids == encode_prompt(tok, messages=msgs, enable_thinking=False)
    assert prompt.enable_thinking is None and prompt.messages is None and prompt.field == "messages"


def test_earliest_stop_wins_whatever_the_list_order():
    m = StopStringMatcher(["b", "ab"])
    assert m.feed("xa") == "x"
    assert m.feed("b") == "" and m.matched == "ab"


def test_longest_possible_stop_prefix_is_held():
    m = StopStringMatcher(["..."])
    assert m.feed("wait..") == "wait"
    assert m.feed(".") == "" and m.matched == "..."


def test_nothing_after_a_match_even_at_finish():
    m = StopStringMatcher(["STOP"])
    assert m.feed("aSTOP") == "a" and m.feed("more") == "" and m.flush() == ""


def test_empty_text_is_one_document_start_token(tok):
    # as the OpenAI API treats an empty prompt: the model generates as from a new document
    assert encode_prompt(tok, text="") == [tok.convert_tokens_to_ids("<|endoftext|>")]
    with pytest.raises(InvalidRequestError) as info:
        encode_prompt(tok, text=5)
    assert info.value.field == "text"

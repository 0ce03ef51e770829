"""Text contracts a plausible bug would break silently (found by mutation testing): stop-string
hold-back and precedence, text released at the end, special tokens kept when asked, the chat
template's thinking switch and roles, long chat prompts encoded beside the worker."""
import subprocess
import sys
import time

import pytest

from checkpoints import make_text_checkpoint
from qil_worker import InvalidRequestError
from qil_worker.service.prompt_encoder import INLINE_CHARS, PromptEncoder
from qil_worker.service.protocol import Submit
from qil_worker.text import StopStringMatcher, encode_prompt, load_tokenizer
from qil_worker.text.detokenizer import IncrementalDetokenizer
from qil_worker.text.output import TextOutput


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return load_tokenizer(make_text_checkpoint(tmp_path_factory.mktemp("t")))


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
    options = {"messages": msgs, "enable_thinking": False}
    assert enc.takes(options)
    enc.start(Submit("r1", None, 4, [], options))
    while not enc.wait(5):
        pass
    ((submit, error, cancelled),) = enc.finished()
    enc.close()
    assert error is None and not cancelled
    assert submit.token_ids == encode_prompt(tok, messages=msgs, enable_thinking=False)
    assert "enable_thinking" not in submit.options and "messages" not in submit.options


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


def test_empty_text_is_refused_naming_text(tok):
    with pytest.raises(InvalidRequestError) as info:
        encode_prompt(tok, text="")
    assert info.value.field == "text"


def test_a_worker_exits_without_waiting_for_a_prompt_still_being_encoded():
    """The worker closes its encoder on STOP; a 16 MiB prompt can take many seconds to encode,
    and the process must not wait for it to end (it did: the pool's thread was joined at exit)."""
    script = (
        "import time\n"
        "from qil_worker.service.prompt_encoder import PromptEncoder\n"
        "from qil_worker.service.protocol import Submit\n"
        "class Slow:\n"
        "    def encode(self, text, add_special_tokens=False):\n"
        "        time.sleep(30); return [1]\n"
        "enc = PromptEncoder(Slow())\n"
        "enc.start(Submit('r1', None, 4, [], {'text': 'x' * 20000}))\n"
        "time.sleep(0.2)\n"
        "enc.close()\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 15, "the process waited for the encode to finish"

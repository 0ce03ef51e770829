"""Sampling, text in and out, stop strings, logprobs and the prefix cache over gRPC.

One real server (front in a thread, worker in a spawned process) on a tiny random model whose
vocabulary is a locally trained byte-level BPE with a chat template; every answer is compared
with the in-process Engine given the same request.
"""

from __future__ import annotations

import asyncio
import math
import subprocess
import sys
import time

import grpc
import pytest

from checkpoints import make_text_checkpoint
from qil_client import AsyncClient, InvalidArgument, pb
from qil_client.results import ResultBuilder
from service_fixtures import start_server, wait_until

ENGINE = dict(num_pages=128, page_size=8, token_budget=256, prefill_chunk=64, max_active=16)
MULTIBYTE = "héllo wörld 中文字符 🙂🚀"
SAMPLED = dict(temperature=0.9, top_p=0.95, top_k=40, repetition_penalty=1.1, seed=1234, ignore_eos=True)


@pytest.fixture(scope="module")
def text_dir(tmp_path_factory):
    return make_text_checkpoint(tmp_path_factory.mktemp("svc-text"))


@pytest.fixture(scope="module")
def server(text_dir):
    srv = start_server(text_dir, engine=ENGINE)
    yield srv
    srv.stop()


class Reference:
    """The in-process Engine with the same model, tokenizer and settings as the server."""

    def __init__(self, model_dir) -> None:
        from qil_worker.engine import Engine
        from qil_worker.model import Qwen3
        from qil_worker.text import load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.engine = Engine(Qwen3.from_directory(model_dir), tokenizer=self.tokenizer, **ENGINE)

    def run(self, token_ids=None, **kw):
        """→ (Result, the request's engine events)."""
        rid = self.engine.submit(token_ids, **kw)
        events = []
        while not self.engine.idle:
            events.extend(e for e in self.engine.step() if e.request_id == rid)
        result = self.engine.result(rid)
        self.engine.release(rid)
        return result, events


@pytest.fixture(scope="module")
def reference(text_dir):
    ref = Reference(text_dir)
    yield ref
    ref.engine.close()


def collect(events) -> tuple[list[pb.Event], object]:
    events = list(events)
    b = ResultBuilder()
    for ev in events:
        b.add(ev)
    return events, b.result()


def assert_aligned(events) -> None:
    for ev in events:
        assert len(ev.logprobs) == len(ev.token_ids)
        assert len(ev.top_logprobs) == len(ev.token_ids)


def test_get_info_reports_tokenizer_prefix_cache_and_page_bytes(client):
    info = client.info()
    assert info.model.has_tokenizer and info.model.has_chat_template
    assert info.prefix_cache.enabled
    # K and V, 2 layers, 8 tokens, 2 KV heads of 16, float32
    assert info.pages.page_bytes == 2 * 2 * 8 * 2 * 16 * 4
    assert info.pages.total == ENGINE["num_pages"]


def test_seeded_sampling_and_logprobs_match_the_in_process_engine(server, client, reference):
    kw = dict(text="hello world", max_new_tokens=24, logprobs=True, top_logprobs=3, **SAMPLED)
    want, ref_events = reference.run(**kw)
    events, got = collect(client.stream(**kw))
    assert got.token_ids == want.output_token_ids
    assert got.finish_reason == "length" and got.stop_reason is None
    assert got.num_prompt_tokens == len(want.prompt_token_ids)
    assert got.text == want.output_text
    assert_aligned(events)
    assert got.logprobs == pytest.approx([e.logprob for e in ref_events], abs=1e-5)
    assert [[t for t, _ in top] for top in got.top_logprobs] == [
        [t for t, _ in e.top_logprobs] for e in ref_events
    ]
    assert [lp for top in got.top_logprobs for _, lp in top] == pytest.approx(
        [lp for e in ref_events for _, lp in e.top_logprobs], abs=1e-5
    )
    assert all(len(top) == 3 for top in got.top_logprobs)
    assert all(lp <= 0 and math.isfinite(lp) for lp in got.logprobs)
    # another seed samples something else; the same seed through the asyncio client the same
    assert client.generate(**{**kw, "seed": 1235}).token_ids != want.output_token_ids

    async def run():
        async with AsyncClient(server.target, timeout=60) as ac:
            return await ac.generate(**kw)

    again = asyncio.run(run())
    assert again.token_ids == want.output_token_ids and again.text == want.output_text


def test_every_other_knob_reaches_the_engine(client, reference):
    kw = dict(text="hello", max_new_tokens=20, temperature=0.8, min_p=0.05, presence_penalty=0.5,
              frequency_penalty=-0.3, min_new_tokens=20, seed=99, skip_special_tokens=False,
              logprobs=True)
    want, _ = reference.run(**kw)
    r = client.generate(**kw)
    assert r.token_ids == want.output_token_ids and r.num_output_tokens == 20  # min_new_tokens: no EOS
    assert r.text == want.output_text == reference.tokenizer.decode(
        r.token_ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
    )
    assert r.logprobs == pytest.approx(client.generate(**kw).logprobs, abs=0)  # reproducible
    assert client.generate(**{**kw, "presence_penalty": 0.0}).token_ids != r.token_ids


def test_without_logprobs_events_carry_none(client):
    events, r = collect(client.stream(text="hello", max_new_tokens=4, temperature=0.5, seed=1))
    assert r.logprobs is None and r.top_logprobs is None
    assert all(not e.logprobs and not e.top_logprobs for e in events)
    assert r.text is not None


def test_text_deltas_are_whole_characters_and_concatenate_to_the_decoded_output(client, reference):
    kw = dict(text=MULTIBYTE, max_new_tokens=48, temperature=1.0, seed=7, ignore_eos=True)
    want, ref_events = reference.run(**kw)
    ids = want.output_token_ids
    # byte-level tokens: some stop mid-character, so some token releases no text of its own
    assert any(e.text == "" for e in ref_events), "expected a token ending mid-character"
    events, got = collect(client.stream(**kw))
    assert got.token_ids == ids
    assert got.text == want.output_text == reference.tokenizer.decode(
        ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    assert all(ev.HasField("text") for ev in events)
    assert got.num_prompt_tokens == len(reference.tokenizer.encode(MULTIBYTE, add_special_tokens=False))


def test_coalesced_replay_keeps_tokens_text_and_logprobs_aligned(client, reference):
    kw = dict(text="the quick", max_new_tokens=30, logprobs=True, top_logprobs=2, **SAMPLED)
    want, ref_events = reference.run(**kw)
    rid = client.submit(request_id="replay-1", **kw)
    wait_until(lambda: client.info().num_unfinished == 0)
    # the request is over: a subscriber gets everything coalesced into one event
    replay = list(client.events(rid))
    assert len(replay) == 1 and replay[0].finished
    assert list(replay[0].token_ids) == want.output_token_ids
    assert replay[0].text == want.output_text
    assert_aligned(replay)
    for k in (1, 7, 29, 30):
        tail = list(client.events(rid, from_seq=k))
        assert tail[0].seq == k
        assert_aligned(tail)
        assert "".join(e.text for e in tail) == "".join(e.text for e in ref_events[k:])
        assert [lp for e in tail for lp in e.logprobs] == pytest.approx(
            [e.logprob for e in ref_events[k:]], abs=1e-5
        )


def _stop_string(text: str) -> tuple[str, int]:
    """A 2-character string first found at index >= 3 of ``text`` (no replacement characters)."""
    for i in range(3, len(text) - 2):
        s = text[i : i + 2]
        if "\ufffd" not in s and text.find(s) == i:
            return s, i
    raise AssertionError(f"no usable stop string in {text!r}")


def test_stop_string_ends_with_stop_and_is_reported(client, reference):
    kw = dict(text="stop here", max_new_tokens=40, **SAMPLED)
    free, _ = reference.run(**kw)
    stop, at = _stop_string(free.output_text)
    for include in (False, True):
        events, r = collect(client.stream(stop_strings=[stop, "never-seen"], include_stop_string=include, **kw))
        assert r.finish_reason == "stop" and r.stop_reason == stop
        assert events[-1].WhichOneof("stop_reason") == "stop_string"
        assert r.text == free.output_text[: at + (2 if include else 0)]
        # the request ended at the token that completed the stop string, not later
        n = len(r.token_ids)
        assert r.token_ids == free.output_token_ids[:n] and n < len(free.output_token_ids)
        assert stop in reference.tokenizer.decode(r.token_ids) and stop not in reference.tokenizer.decode(
            r.token_ids[:-1]
        )
        same, _ = reference.run(stop_strings=[stop, "never-seen"], include_stop_string=include, **kw)
        assert r.token_ids == same.output_token_ids and r.text == same.output_text


def test_stop_token_is_reported(client, reference):
    kw = dict(text="hello", max_new_tokens=20, **SAMPLED)
    free, _ = reference.run(**kw)
    stop = free.output_token_ids[4]
    events, r = collect(client.stream(stop_token_ids=[stop], **kw))
    assert r.finish_reason == "stop" and r.stop_reason == stop and r.token_ids[-1] == stop
    assert events[-1].WhichOneof("stop_reason") == "stop_token_id"
    assert r.token_ids == free.output_token_ids[: free.output_token_ids.index(stop) + 1]


def test_chat_messages_over_unary_and_session(client, reference):
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello world"},
    ]
    for thinking in (False, None):
        kw = dict(messages=messages, max_new_tokens=12, enable_thinking=thinking)
        want, _ = reference.run(**kw)
        r = client.generate(**kw)
        assert r.token_ids == want.output_token_ids and r.text == want.output_text
        assert r.num_prompt_tokens == len(want.prompt_token_ids)
    rendered = reference.tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
    )
    assert len(want.prompt_token_ids) < len(reference.tokenizer.encode(rendered, add_special_tokens=False))
    # StreamEvents: the submitted frame says how long the rendered prompt is
    want, _ = reference.run(messages=messages, max_new_tokens=6, temperature=0.7, seed=3)
    with client.session() as s:
        s.submit(messages=[("system", "be brief"), ("user", "hello world")], max_new_tokens=6,
                 temperature=0.7, seed=3, request_id="chat-s")
        s.submit(text="x", temperature=float("nan"), request_id="chat-bad")
        s.close()
        b, acks, errors = ResultBuilder(), [], []
        for resp in s:
            kind = resp.WhichOneof("frame")
            if kind == "submitted":
                acks.append(resp.submitted)
            elif kind == "error":
                errors.append(resp.error)
            elif kind == "event":
                b.add(resp.event)
    assert [a.request_id for a in acks] == ["chat-s"]
    assert acks[0].num_prompt_tokens == len(want.prompt_token_ids)
    assert b.result().token_ids == want.output_token_ids and b.result().text == want.output_text
    assert len(errors) == 1 and errors[0].field == "temperature"
    assert errors[0].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]


NAN, INF = float("nan"), float("inf")


def test_an_empty_chat_is_refused_naming_messages(client):
    """proto3 cannot send an empty message list (the server would see no prompt and blame
    token_ids): the client refuses it, naming messages."""
    for call in (client.submit, client.generate):
        with pytest.raises(ValueError, match="^messages: must hold at least one message"):
            call(text=None, messages=[])
    assert client.info().num_unfinished == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.5), "temperature"),
        (dict(temperature=NAN), "temperature"),
        (dict(temperature=INF), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=NAN), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(min_p=-0.1), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=NAN), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(repetition_penalty=-INF), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(presence_penalty=NAN), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(frequency_penalty=INF), "frequency_penalty"),
        (dict(min_new_tokens=11, max_new_tokens=10), "min_new_tokens"),
        (dict(top_logprobs=21), "top_logprobs"),
        (dict(stop_strings=[""]), "stop_strings"),
        (dict(stop_strings=["x" * 257]), "stop_strings"),
        (dict(stop_strings=["a"] * 17), "stop_strings"),
        (dict(text=None, messages=[{"role": "robot", "content": "hi"}]), "messages[0]"),
        (dict(token_ids=[1, 2]), "text"),  # two prompts
        (dict(messages=[("user", "hi")]), "messages"),
        # tokenized on the worker's encoding thread (long), then refused as any other
        (dict(text="hello " * 4000), "text"),  # the prompt alone cannot fit
        (dict(text=None, messages=[{"role": "robot", "content": "hi " * 6000}]), "messages[0]"),
    ],
)
def test_bad_values_are_invalid_argument_naming_the_field(client, kwargs, field):
    kw = {"text": "hello", **kwargs}
    for call in (client.submit, client.generate):
        with pytest.raises(InvalidArgument) as exc:
            call(**kw)
        assert exc.value.field == field
        assert exc.value.details.startswith(field + ":")
    assert client.info().num_unfinished == 0


def test_prefix_cache_hit_reports_cached_tokens(client):
    prompt = [(11 * i + 5) % 250 for i in range(42)]  # 5 full pages of 8 and 2 tokens
    first = client.generate(prompt, max_new_tokens=4)
    second = client.generate(prompt, max_new_tokens=4)
    assert first.num_cached_tokens == 0
    assert 8 <= second.num_cached_tokens <= 40 and second.num_cached_tokens % 8 == 0
    assert second.token_ids == first.token_ids
    info = client.info()
    assert info.prefix_cache.enabled and 0 < info.prefix_cache.hit_rate <= 1
    assert info.pages.cached > 0 and info.pages.used == 0


def test_a_worker_exits_without_waiting_for_a_prompt_still_being_encoded():
    """The worker closes its encoder on STOP; a 16 MiB prompt can take many seconds to encode,
    and the process must not wait for it to end (it did: the pool's thread was joined at exit)."""
    script = (
        "import threading, time\n"
        "from qil_worker.service.worker.prompt_encoder import PromptEncoder\n"
        "from qil_worker.engine.spec import RequestSpec\n"
        "from qil_worker.service.worker.beside_loop import Pending\n"
        "started = threading.Event()\n"
        "class Slow:\n"
        "    def encode(self, text, add_special_tokens=False):\n"
        "        started.set(); time.sleep(30); return [1]\n"  # the slow encode under test
        "enc = PromptEncoder(Slow())\n"
        "enc.start(Pending(RequestSpec.of(text='x' * 20000, max_new_tokens=4, request_id='r1')))\n"
        "assert started.wait(30)\n"
        "enc.close()\n"
    )
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - t0 < 15, "the process waited for the encode to finish"

"""Per-request sampling controls, validated once at submit."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, fields

from qil_worker.errors import InvalidRequestError
from qil_worker.request_limits import MAX_LOGIT_BIAS, MAX_SAMPLES, MAX_TOP_LOGPROBS, check_count

# The sampler works in float32. A temperature under GREEDY_BELOW would divide logits out of the
# range where softmax means anything (1e-40 already gave NaN rows and the last token id), so
# it is greedy decoding, its limit. Temperatures and repetition penalties past these bounds
# are refused: no use of them differs from the bound itself, and extremes overflow float32.
GREEDY_BELOW = 1e-5
MAX_TEMPERATURE = 100.0
REPETITION_PENALTY_RANGE = (0.01, 100.0)
# logit_bias: OpenAI's range. ±100 already bans or forces a token against any logit a sane model
# produces, so nothing past it is needed (the count: ``request_limits``).
LOGIT_BIAS_RANGE = (-100.0, 100.0)


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. The defaults give plain greedy decoding.

    temperature: 0 (or anything under 1e-5) means greedy (argmax, no noise); otherwise logits
    are divided by it; at most 100.
    top_k: keep the k most likely tokens (0 or -1: off). top_p: keep the smallest set whose
    probability reaches p (1: off). min_p: drop tokens below min_p × the top token's probability.
    repetition_penalty: divide positive / multiply negative logits of tokens already in the
    prompt or output (1: off; 0.01 to 100). presence_penalty / frequency_penalty: subtract a
    constant / a per-occurrence amount from logits of tokens already generated (0: off).
    seed: makes sampling reproducible whatever else is in the batch (None: a random seed).
    min_new_tokens: EOS and stop ids are masked until this many tokens exist.
    ignore_eos: the model's EOS ids do not stop the request (stop_token_ids still do).
    n: samples of the prompt in this one request, 1 to 64 (``qil_worker.engine.samples``).
    logprobs: return the chosen token's log-probability; top_logprobs: and the N best (≤ 20).
    prompt_logprobs: None (off), or return every prompt token's log-probability after the first
    under the raw model (no bias, penalties or temperature) and the N best at each (0 to 20).
    logit_bias: (token id, bias) pairs added to those logits before everything else; a dict is
    accepted and kept as pairs sorted by id (hashable). In [-100, 100], at most 300 ids.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    min_new_tokens: int = 0
    ignore_eos: bool = False
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        bias = self.logit_bias
        if isinstance(bias, Mapping):
            bias = tuple(bias.items())
        if isinstance(bias, (list, tuple)):
            try:
                bias = tuple(sorted((tuple(pair) for pair in bias), key=lambda pair: pair[0]))
            except (TypeError, IndexError):
                bias = tuple(bias)  # left as given: ``validate`` names what is wrong with it
            object.__setattr__(self, "logit_bias", bias)

    @classmethod
    def from_kwargs(cls, **kwargs: object) -> "SamplingParams":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise InvalidRequestError(unknown[0], "unknown sampling parameter")
        return cls(**kwargs)  # type: ignore[arg-type]

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalized(self) -> bool:
        return (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )

    @property
    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    def validate(self, max_new_tokens: int, vocab_size: int | None = None) -> None:
        """Raise ``InvalidRequestError`` naming the first out-of-range field (``vocab_size``:
        the model's, which logit_bias ids must be under)."""
        _number("temperature", self.temperature, low=0.0, high=MAX_TEMPERATURE)
        _integer("top_k", self.top_k, low=-1)
        _number("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _number("min_p", self.min_p, low=0.0, high=1.0)
        _number("repetition_penalty", self.repetition_penalty, *REPETITION_PENALTY_RANGE)
        _number("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _number("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _integer("seed", self.seed, low=0, high=2**64 - 1)
        _integer("min_new_tokens", self.min_new_tokens, low=0, high=max_new_tokens)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidRequestError("ignore_eos", "must be a boolean")
        _integer("n", self.n, low=1, high=MAX_SAMPLES)
        if not isinstance(self.logprobs, bool):
            raise InvalidRequestError("logprobs", "must be a boolean")
        _integer("top_logprobs", self.top_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_TOP_LOGPROBS)
        self._validate_logit_bias(vocab_size)

    def check_vocab(self, vocab_size: int) -> None:
        """After ``validate``: the logit_bias ids are under the model's ``vocab_size``."""
        if self.logit_bias and self.logit_bias[-1][0] >= vocab_size:  # sorted by id
            token = self.logit_bias[-1][0]
            raise InvalidRequestError("logit_bias", f"token id {token} is outside [0, {vocab_size})")

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple):
            raise InvalidRequestError("logit_bias", f"must map token ids to biases, got {bias!r}")
        check_count("logit_bias", len(bias), MAX_LOGIT_BIAS, "token ids")
        low, high = LOGIT_BIAS_RANGE
        previous = None
        for pair in bias:  # sorted by id (``__post_init__``), so a repeated id is adjacent
            if not isinstance(pair, tuple) or len(pair) != 2:
                raise InvalidRequestError("logit_bias", f"must map token ids to biases, got {pair!r}")
            token, value = pair
            try:
                if isinstance(token, bool):
                    raise TypeError
                token = operator.index(token)
            except TypeError:
                raise InvalidRequestError("logit_bias", f"token ids must be integers, got {token!r}") from None
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                upper = vocab_size if vocab_size is not None else "inf"
                raise InvalidRequestError("logit_bias", f"token id {token} is outside [0, {upper})")
            if token == previous:
                raise InvalidRequestError("logit_bias", f"token id {token} is given twice")
            previous = token
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise InvalidRequestError("logit_bias", f"token {token}: the bias must be a finite number, got {value!r}")
            if not low <= value <= high:
                raise InvalidRequestError("logit_bias", f"token {token}: the bias must be in [{low}, {high}], got {value}")

def _number(
    field: str, value: object, low: float, high: float | None = None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(field, f"must be a finite number, got {value!r}")
    if value < low or (low_open and value == low) or (high is not None and value > high):
        bound = f"{'(' if low_open else '['}{low}, {high if high is not None else 'inf'}" + (
            "]" if high is not None else ")"
        )
        raise InvalidRequestError(field, f"must be in {bound}, got {value!r}")


def _integer(field: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(field, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        raise InvalidRequestError(
            field, f"must be in [{low}, {high if high is not None else 'inf'}], got {value}"
        )

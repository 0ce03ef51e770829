"""The optional options of one request, listed once.

Each is a proto3 ``optional`` scalar field of ``qil.v1.SubmitRequest`` with the same name (and
Python type), left unset unless given so that the server's default applies. Everything else that
names them derives from this table: the flags of ``python -m qil_client`` and of ``python -m
qil_worker generate``, what the client CLI sends, and what the front copies from a request into
``Engine.submit``. ``tests/service/test_request_options.py`` checks the table against the proto, the
engine's ``SamplingParams``, ``submit_request``'s keyword arguments and both command lines, so a
parameter added in one place and forgotten in another fails there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from google.protobuf.descriptor import FieldDescriptor

from qil_client._proto.qil.v1 import inference_pb2 as pb

_PYTHON_TYPES = {
    FieldDescriptor.TYPE_DOUBLE: float,
    FieldDescriptor.TYPE_INT32: int,
    FieldDescriptor.TYPE_UINT32: int,
    FieldDescriptor.TYPE_UINT64: int,
    FieldDescriptor.TYPE_BOOL: bool,
}


@dataclass(frozen=True)
class RequestOption:
    name: str  # the SubmitRequest field and keyword argument; the flag is its name with dashes
    help: str | None = None  # command-line help
    type: type = field(init=False)  # float, int or bool, from the proto field

    def __post_init__(self) -> None:
        proto_field = pb.SubmitRequest.DESCRIPTOR.fields_by_name[self.name]  # KeyError: not on the wire
        object.__setattr__(self, "type", _PYTHON_TYPES[proto_field.type])

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


# How the next token is chosen: fields of the engine's SamplingParams, flags of both CLIs.
SAMPLING = (
    RequestOption("temperature", "0 = greedy (default)"),
    RequestOption("top_k", "keep the k most likely tokens (0 or -1: off)"),
    RequestOption("top_p", "keep the fewest tokens whose probability reaches p (1: off)"),
    RequestOption("min_p", "drop tokens below min_p times the top one's probability (0: off)"),
    RequestOption("repetition_penalty", "penalize tokens in the prompt or output (1: off; 0.01 to 100)"),
    RequestOption("presence_penalty", "penalize tokens already generated (0: off; -2 to 2)"),
    RequestOption("frequency_penalty", "penalize tokens per time generated (0: off; -2 to 2)"),
    RequestOption("seed", "reproducible sampling whatever else is in the batch (default: random)"),
    RequestOption("min_new_tokens", "no EOS or stop id before this many tokens"),
    RequestOption("ignore_eos", "the model's EOS ids do not stop the request"),
    RequestOption("n", "samples of the prompt in one request (1 to 64; default 1)"),
)
# Log-probabilities returned (with each token; the prompt's with the first): the other scalar
# fields of SamplingParams; flags of the client CLI only.
LOGPROBS = (RequestOption("logprobs"), RequestOption("top_logprobs"), RequestOption("prompt_logprobs"))
# How the text is made: keyword arguments of Engine.submit; flags of the client CLI only.
TEXT = (
    RequestOption("include_stop_string"),
    RequestOption("skip_special_tokens"),
    RequestOption("enable_thinking"),
)
OPTIONS = SAMPLING + LOGPROBS + TEXT
NAMES = tuple(o.name for o in OPTIONS)


def add_flags(parser: argparse.ArgumentParser, options: tuple[RequestOption, ...]) -> None:
    """One flag per option, default None (not sent: the server's or the engine's default)."""
    for o in options:
        if o.type is bool:
            parser.add_argument(o.flag, action="store_true", default=None, help=o.help)
        else:
            parser.add_argument(o.flag, type=o.type, default=None, help=o.help)


def logit_bias_entry(text: str) -> tuple[int, float]:
    """An argparse type for ``--logit-bias ID=BIAS`` (ranges are the server's to check)."""
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, e.g. 42=-100, got {text!r}") from None


def add_logit_bias_flag(parser: argparse.ArgumentParser) -> None:
    """``--logit-bias ID=BIAS``, repeatable (a map on the wire, so not in the table above)."""
    parser.add_argument(
        "--logit-bias", type=logit_bias_entry, action="append", default=None, metavar="ID=BIAS",
        help="add BIAS (-100 to 100) to token ID's logit (repeatable; a later one for an id wins; "
        "default: none)",
    )


def given(args: argparse.Namespace, options: tuple[RequestOption, ...] = OPTIONS) -> dict[str, object]:
    """The options among ``options`` that the command line set, by name."""
    values = {o.name: getattr(args, o.name) for o in options}
    return {name: value for name, value in values.items() if value is not None}

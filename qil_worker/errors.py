"""Exceptions a user can act on; the service maps each kind to one gRPC status code."""

from __future__ import annotations


class QilError(Exception):
    """Base class of every error qil raises on purpose."""


class ConfigError(QilError):
    """The model's config.json describes something qil does not support."""


class WeightError(QilError):
    """A checkpoint's tensors do not match the config (missing, unknown or mis-shaped)."""


class InvalidRequestError(QilError, ValueError):
    """A request is malformed: bad token ids, impossible lengths, bad parameters.

    ``field`` names the offending field so the service can report it.
    """

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class CapacityError(InvalidRequestError):
    """A request can never fit: the whole KV pool or the model's positions are too small."""

    @classmethod
    def positions(
        cls, prompt_tokens: int, max_new_tokens: int, max_positions: int, prompt_field: str = "token_ids"
    ) -> "CapacityError":
        """Prompt + max_new_tokens beyond the model's positions (the engine checks it; the
        service's front too, before it ships a huge prompt to the worker). The prompt's field
        (``prompt_field``: token_ids, text or messages) is blamed when the prompt alone leaves
        no room for one new token, else max_new_tokens."""
        total = prompt_tokens + max_new_tokens
        return cls(
            prompt_field if prompt_tokens >= max_positions else "max_new_tokens",
            f"prompt ({prompt_tokens}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
            f"model's {max_positions} positions",
        )


class DeviceFailedError(QilError):
    """The device failed in a way that poisons every later call (a sticky CUDA error such as an
    illegal memory access): the engine refuses work; only a new process can use the device."""


class UnknownRequestError(QilError, KeyError):
    """No request with this id is known to the engine."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else "unknown request"


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is still active."""

    def __init__(self, request_id: str) -> None:
        super().__init__("request_id", f"a request with id {request_id!r} is still active")


class TokenizerUnavailableError(QilError):
    """Text was asked for but no tokenizer is loaded (FAILED_PRECONDITION over gRPC).

    ``field`` names the part of the request that needed it (text, messages, stop_strings).
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class FeatureUnavailableError(QilError):
    """A request needs something this worker lacks: an optional extra that is not installed, or a
    tokenizer the engine was started without (FAILED_PRECONDITION over gRPC).

    ``field`` names the part of the request that needed it (e.g. ``json_schema``); the message
    says what is missing and how to get it.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field

"""What ``wait_ready`` (sync and asyncio) makes of each health answer while it waits."""

from __future__ import annotations

from typing import NoReturn

import grpc

from qil_client.errors import QilError


def connection_refused(err: QilError) -> bool:
    """Nothing listens at the target. gRPC reports it as UNAVAILABLE with the socket's error in
    the details; a name that does not resolve (yet), a failed TLS handshake or a timeout are
    other failures."""
    return err.code == grpc.StatusCode.UNAVAILABLE and "connection refused" in err.details.lower()


class ReadyWait:
    """The answers of one wait: SERVING ends it, a refused connection may, and a wait that runs
    out of time says what the server last answered."""

    def __init__(self, timeout: float, fail_when_refused: bool) -> None:
        self.timeout = timeout
        self.fail_when_refused = fail_when_refused
        self.last: str | QilError | None = None

    def ready(self, answer: str | QilError) -> bool:
        """True for SERVING; raises ``answer`` when it is a refused connection that ends the wait."""
        self.last = answer
        if isinstance(answer, QilError):
            if self.fail_when_refused and connection_refused(answer):
                raise answer
            return False
        return answer == "SERVING"

    def give_up(self) -> NoReturn:
        last = self.last
        if isinstance(last, QilError):
            raise TimeoutError(f"server not SERVING within {self.timeout:g} s (last error: {last})") from last
        raise TimeoutError(f"server not SERVING within {self.timeout:g} s (last status: {last})")

"""Client library of the qil gRPC service (qil.v1.Inference). Does not need torch.

    from qil_client import Client
    with Client("127.0.0.1:50051") as client:
        result = client.generate([1, 2, 3], max_new_tokens=8)
        result = client.generate(text="Once upon a time", temperature=0.7, top_p=0.9, seed=1,
                                 stop_strings=["\n\n"], logprobs=True)
        print(result.text, result.finish_reason, result.stop_reason)
"""

from qil_client._channel import TLS
from qil_client._proto.qil.v1 import inference_pb2 as pb
from qil_client.aio import AsyncClient, AsyncSession
from qil_client.client import Client, Session
from qil_client.errors import (
    AlreadyExists,
    Cancelled,
    DeadlineExceeded,
    FailedPrecondition,
    Internal,
    InvalidArgument,
    NotFound,
    QilError,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from qil_client.results import Metrics, Result, TokenizeResult, Usage
from qil_client.retrieval import Embeddings, Ranked
from qil_client.tools import StreamedCalls, ToolCall

__all__ = [
    "AlreadyExists", "AsyncClient", "AsyncSession", "Cancelled", "Client", "DeadlineExceeded", "Embeddings",
    "FailedPrecondition", "Internal", "InvalidArgument", "Metrics", "NotFound", "QilError", "Ranked",
    "ResourceExhausted", "Result", "Session", "StreamedCalls", "TLS", "TokenizeResult", "ToolCall", "Unauthenticated", "Unavailable",
    "Usage", "pb",
]

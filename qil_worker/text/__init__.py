"""Text around the token engine: loading tokenizers, encoding prompts, streaming text out."""

from qil_worker.text.detokenizer import IncrementalDetokenizer
from qil_worker.text.prompt import encode_prompt
from qil_worker.text.stop_strings import StopStringMatcher
from qil_worker.text.tokenizer import load_tokenizer

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "encode_prompt", "load_tokenizer"]

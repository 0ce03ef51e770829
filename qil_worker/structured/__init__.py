"""Structured output: a request's output constrained to a JSON schema, any JSON object, a regex, a
Lark grammar or one of a list of strings.

``spec`` (torch- and llguidance-free) validates what a request asks for; ``compiler`` turns it
into a grammar matcher (llguidance, imported lazily, only there); ``matcher`` is a request's
state; ``bitmask`` fills the step's masks into one tensor and applies them in the sampler.

Backend: llguidance, measured against xgrammar 0.2.9 on our workload (docs/structured-output-library.md):
- xgrammar 0.2.9 emits invalid JSON inside maxLength/minLength strings (raw control characters
  allowed, every escape forbidden; upstream mlc-ai/xgrammar#800) and silently turns an
  unsatisfiable allOf into "any JSON"; llguidance gets both right.
- llguidance compiles lazily and is bounded (LLParserLimits), so a new schema costs milliseconds
  and a hostile one an error; xgrammar compiles eagerly, linear in the vocabulary, without limits.
- llguidance is a dependency-free wheel; xgrammar requires torch, transformers and triton.
Its cost: masks are computed lazily, so rows inside length-bounded strings cost more per step.
Never import ``llguidance.torch``: it pulls in torch._dynamo, and its apply runs torch.compile.
"""

from qil_worker.structured.spec import (
    CONSTRAINT_KINDS,
    MAX_CHOICE_CHARS,
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    ConstraintSpec,
)

__all__ = ["CONSTRAINT_KINDS", "MAX_CHOICES", "MAX_CHOICE_CHARS", "MAX_CONSTRAINT_CHARS", "ConstraintSpec"]

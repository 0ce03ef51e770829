"""Names of the attention backends a worker can run (torch-free, so the front's CLI offers them).

``sdpa``: keys gathered per group of similar requests, padded, attended with SDPA (any device;
on CPU the CPU's own kernels, see ``attention.cpu``). ``varlen``: torch's varlen flash attention
reading the page pool through a block table (CUDA, torch builds whose ``varlen_attn`` takes
``block_table``). ``varlen-packed``: the same kernel on every request's keys gathered back to
back (CUDA, any build with ``varlen_attn``). ``varlen-pages``: decode rows attended page by
page where the pages lie, merged by their log-sum-exps, through the flash kernel's
``seqused_k`` (CUDA builds without a block table); steps with prefill chunks as
``varlen-packed``. ``auto``: ``varlen`` where it works, else ``sdpa``.
See ``qil_worker.attention.choice``.
"""

SDPA = "sdpa"
PAGED = "varlen"
PACKED = "varlen-packed"
SEGMENTS = "varlen-pages"
ATTENTION_CHOICES = ("auto", SDPA, PAGED, PACKED, SEGMENTS)

"""selfattn: self-attention for PyTorch that is correct by construction.

Example:
    >>> import torch, selfattn
    >>> q = k = v = torch.randn(2, 8, 128, 64)                   # (B, H, L, D)
    >>> out = selfattn.attention(q, k, v, causal=True)
    >>> out = selfattn.attention(q, k, v, mask=selfattn.masks.sliding_window(32))
    >>> cu = torch.tensor([0, 100, 128], dtype=torch.int32)      # two packed sequences
    >>> out = selfattn.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu)
"""

from . import masks, scores, testing
from .cache import KVCache
from .check import check, check_model
from .functional import Explanation, attention, attention_with_weights, explain, use_backend
from .nn import MultiHeadAttention, SelfAttention
from .paged import paged_attention
from .paged_cache import PagedKVCache
from .rope import rope
from .varlen import varlen_attention, varlen_explain

__all__ = [
    "Explanation",
    "KVCache",
    "MultiHeadAttention",
    "PagedKVCache",
    "SelfAttention",
    "attention",
    "attention_with_weights",
    "check",
    "check_model",
    "explain",
    "masks",
    "paged_attention",
    "rope",
    "scores",
    "testing",
    "use_backend",
    "varlen_attention",
    "varlen_explain",
]

__version__ = "0.1.0"

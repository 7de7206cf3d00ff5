"""Pallas Mosaic GPU kernels for jaxkv, with same-signature pure-jnp references.

This package sees raw arrays only and never imports jaxkv.
"""

from pallas_kernels import indexing
from pallas_kernels.kv_write import kv_write, kv_write_reference, static_validate_kv_write
from pallas_kernels.varlen_attention import (
    static_validate_varlen_attention,
    varlen_attention,
    varlen_attention_reference,
)

__all__ = [
    "indexing",
    "kv_write",
    "kv_write_reference",
    "static_validate_kv_write",
    "static_validate_varlen_attention",
    "varlen_attention",
    "varlen_attention_reference",
]

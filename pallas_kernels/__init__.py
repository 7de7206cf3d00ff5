"""Pallas Mosaic GPU kernels for jaxkv, with same-signature pure-jnp references.

This package sees raw arrays only and never imports jaxkv.
"""

from pallas_kernels import indexing
from pallas_kernels.kv_write import (
    check_kv_write,
    kv_write,
    kv_write_reference,
    static_validate_kv_write,
)
from pallas_kernels.paged import (
    check_paged,
    paged_kv_write,
    paged_kv_write_reference,
    paged_varlen_attention,
    paged_varlen_attention_reference,
)
from pallas_kernels.skinny_gemm import skinny_matmul, skinny_matmul_refusal
from pallas_kernels.varlen_attention import (
    check_varlen_attention,
    static_validate_varlen_attention,
    varlen_attention,
    varlen_attention_reference,
)

__all__ = [
    "check_kv_write",
    "check_paged",
    "check_varlen_attention",
    "indexing",
    "kv_write",
    "kv_write_reference",
    "paged_kv_write",
    "paged_kv_write_reference",
    "paged_varlen_attention",
    "paged_varlen_attention_reference",
    "skinny_matmul",
    "skinny_matmul_refusal",
    "static_validate_kv_write",
    "static_validate_varlen_attention",
    "varlen_attention",
    "varlen_attention_reference",
]
